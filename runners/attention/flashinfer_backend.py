"""flashinfer attention over the paged (page size 1) KV cache, with the CUDA-graph-safe plan.

Draft-extend (and any multi-token extend) runs BatchPrefillWithPagedKVCacheWrapper with a
causal mask; one-token-per-request DECODE runs BatchDecodeWithPagedKVCacheWrapper (tensor
cores on, so both use the same fa2 module and the first run JIT-compiles one module).

The plan is host work (it reads the lengths on the host and writes a work partition
into the wrapper's int workspace), so it can never run inside a graph. As the engines do:
- eager passes plan wrappers of their own (`use_cuda_graph=False`: any row count), graph buckets
  theirs; a graph runner names the batches it captures with before its warm-ups
  (`init_forward_metadata_capture_cuda_graph`, flashinfer_plan.GraphBatches). Shared, the first
  plan of a bucket's wrapper would fix its rows for an eager prompt prefill of the same batch size;
- per wrapper set, one wrapper per (kind, batch size), and for the single-layer draft decode one per (batch size,
  step) as the engine's multi-step draft backend keeps them; a graph bucket's built with `use_cuda_graph=True` and
  fixed buffers for qo_indptr / kv_indptr / kv_indices / last_page_len, so a graph captured with
  it reads those buffers at fixed addresses. The wrappers of one batch size (a draft decode's
  steps) share one buffer set: every step's indptrs sit in one int32 buffer, so a plan writes
  them with one host-to-device copy from the group's pinned staging buffer, where the host
  lengths were written (flashinfer_plan.kv_index_plan). The kv_indices the indptrs point into are
  written on the device by the pass's first layer (flashinfer_kv_indices, one kernel per
  wrapper, as the engine builds them): under capture that kernel is in the graph, so a replay
  rebuilds them from the replay fill's request rows and the draft slots its own body assigned;
- eager steps and graph warm-ups plan with the batch's live metadata before the kernel
  runs (flashinfer's own plan); the capture run does not plan (it records the kernels of the
  plan its warm-up left);
- before every replay the graph runner calls `init_forward_metadata_replay_cuda_graph(fb)`
  with the bucket's batch, whose tensors hold the live lanes by then: the indptrs are written
  from the live lanes' host lengths and each wrapper's work partition is re-planned by
  flashinfer's planner alone, as the engine's fast plans do (flashinfer always splits the KV in
  CUDA-graph mode, so the replayed grid, baked into the graph, does not depend on the lengths);
  a draft-decode bucket writes all its steps' buffers at once, then plans each step;
- that re-plan is skipped when nothing it reads was written since the wrapper's last plan
  (`plan_inputs_key`): the multi-layer draft-extend steps of an iteration share one buffer
  set and one wrapper per bucket, and only the chain inputs change between steps, so the
  steps' graphs are planned once per iteration, at the first step (the engine stages the
  metadata once in the multi-step runner's prepare for the same reason). A plan is host work
  (the index, the work partition, their uploads), which a per-step plan would pay once per
  draft layer.

A TARGET_VERIFY batch (its tree mask in `EagleVerifyInput`) runs only while every lane's tree is
a chain: this backend plans a causal mask, which is then exactly the tree mask (node i at
position root + i sees the prefix and nodes 0..i). The verify graph runner hands every batch its
mask, chains included, so the check runs at every plan, eager or before a replay (the replay plan
reads the graph's mask buffer as filled); a real tree is refused there, never run with the wrong
mask. Under capture there is no plan: the capture-time fill is the chain mask.

Semantics match the reference for real lanes (query i of a request of qo_len T and
kv_len S sees keys j <= S - T + i, i.e. key_pos <= position when positions are
prefix + i). Padded lanes (seq_len = fill value 1 < T) are planned with kv_len = T so
every row sees at least one key (an all-masked row could turn into NaN and spread
through the padding slot); their rows are garbage either way and are sliced off.

flashinfer has no fp32 kernels: an fp32 model runs this backend's attention in bf16
(q and the layer's KV cast, the output cast back); harness/tolerances.py holds the
looser tolerances that follow.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from runners.attention.flashinfer_kv_indices import write_kv_indices
from runners.attention.flashinfer_plan import (
    GraphBatches,
    KvIndexPlan,
    WrapperSet,
    draft_decode_plan,
    host_seq_lens,
    packed_len,
    pass_plan,
    plan_inputs_key,
)
from runners.batch import ForwardBatch, ForwardMode
from runners.eagle_draft import DraftDecodeSpecInfo
from runners.graph import record as graph_record
from runners.memory import ReqToTokenPool, TokenToKVPool
from runners.verify import chain_mask

SUPPORTED_HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 128 * 1024 * 1024
FAST_PLAN_VERSION = "0.6.8"  # the release whose planner arguments `_replan` passes (pyproject's gpu extra pins it)


@dataclass
class _Group:
    """The wrappers of one (kind, batch): one wrapper, or the draft decode's one per step, over one set of device
    buffers. `meta` holds qo_indptr and every step's kv_indptr (the wrappers' indptr buffers are views of it), so one
    host-to-device copy from `staging` writes them all; step s's wrapper reads row s of `kv_indices`."""

    kind: str  # "prefill" | "decode"
    wrappers: WrapperSet  # eager (use_cuda_graph=False) or a graph bucket's
    lanes: int  # the wrappers' batch (requests; draft-decode lanes)
    steps: int
    cap: int  # KV slots a step can hold
    meta: torch.Tensor  # int32 [(1 + steps) * (lanes + 1)]
    kv_indices: torch.Tensor  # int32 [steps, cap]
    staging: torch.Tensor  # pinned int32, meta's size: where a plan writes the host lengths for the one upload
    upload_event: Any  # recorded after each plan's uploads (the staging copy, flashinfer's work partition)
    staged: int = 0  # plans written into `staging` so far (a plan's args know which one is theirs)

    def kv_indptr(self, step: int) -> torch.Tensor:
        n = self.lanes + 1
        return self.meta[(1 + step) * n: (2 + step) * n]


@dataclass
class _Wrapper:
    group: _Group
    step: int
    wrapper: Any
    plans: int = 0
    replans_skipped: int = 0
    plan_key: Optional[tuple] = None  # what the last plan read (plan_inputs_key); None: an eager or warm-up plan
    plan_refs: tuple = ()  # keeps the keyed tensors alive, so no new tensor can take their storage address

    @property
    def kind(self) -> str:
        return self.group.kind


@dataclass
class _PlanArgs:
    index: KvIndexPlan  # host: the indptrs, in the group's staging buffer
    stage: int  # which of the group's staged plans it is
    written: bool = False  # the group's buffers hold it (a draft decode's steps share one write)


@dataclass
class FlashInferMetadata:
    entry: _Wrapper
    args: Optional[_PlanArgs]  # None under capture: the kernels use the warm-up's plan
    planned: bool = False
    per_req: int = 1  # lanes per request (a draft decode's topk)
    own: Optional[torch.Tensor] = None  # a draft decode's slots [lanes, steps]; the step's lanes read their first own_len
    own_len: int = 0
    indexed: bool = False  # the pass's kv_indices are written (by its first layer)


class FlashInferAttnBackend:
    name = "flashinfer"

    def __init__(self, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool):
        import flashinfer  # the optional extra; imported only when the backend is built

        if flashinfer.__version__ != FAST_PLAN_VERSION:
            raise ValueError(f"the flashinfer backend's replay plan calls flashinfer {FAST_PLAN_VERSION}'s planner directly; "
                             f"flashinfer {flashinfer.__version__} is installed: pip install flashinfer-python=={FAST_PLAN_VERSION}")
        self.fi = flashinfer
        self.req_pool, self.kv_pool = req_pool, kv_pool
        k0 = kv_pool.k[0]
        self.device = k0.device
        if self.device.type != "cuda":
            raise ValueError("the flashinfer backend needs its KV pool on a CUDA device")
        self.num_kv_heads, self.head_dim = int(k0.shape[1]), int(k0.shape[2])
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"the flashinfer backend supports head_dim in {SUPPORTED_HEAD_DIMS}, this model has {self.head_dim} "
                "(hidden_size / num_heads): use a model with e.g. hidden_size=512, num_heads=8"
            )
        self.compute_dtype = k0.dtype if k0.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        self.max_ctx = int(req_pool.req_to_token.shape[1])
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.num_qo_heads: Optional[int] = None
        self.readbacks = 0  # plans that read lengths back from the device (a sync); host copies avoid them
        self._wrappers: dict[tuple, _Wrapper] = {}
        self.graph_batches = GraphBatches()
        self._chains: dict[tuple[int, str], torch.Tensor] = {}  # the chain mask of T nodes, per device

    # ---- wrappers and plans ----
    @staticmethod
    def _kind(fb: ForwardBatch) -> str:
        return "decode" if fb.forward_mode is ForwardMode.DECODE else "prefill"

    def _entry(self, wrappers: WrapperSet, kind: str, bs: int, lanes: Optional[int] = None, steps: int = 0, step: int = 0) -> _Wrapper:
        """The wrapper of (set, kind, bucket) or, for the draft decode (steps > 0), of (set, bucket, step) over `lanes`
        lanes, each reading at most max_ctx + steps keys; a draft decode's steps are built together, one group."""
        key = (wrappers, kind, bs) if not steps else (wrappers, "draft_decode", bs, step)
        if key not in self._wrappers:
            lanes = bs if lanes is None else lanes
            n_steps = max(steps, 1)
            cap = max(lanes, 1) * (self.max_ctx + steps)
            i32 = dict(dtype=torch.int32, device=self.device)
            n = packed_len(lanes, n_steps)
            group = _Group(kind, wrappers, lanes, n_steps, cap, torch.zeros(n, **i32), torch.zeros(n_steps, cap, **i32),
                           torch.zeros(n, dtype=torch.int32, pin_memory=True), torch.cuda.Event())
            last_page_len = torch.ones(lanes, **i32)  # page size 1: never rewritten
            for s in range(n_steps):
                self._wrappers[(wrappers, kind, bs) if not steps else (wrappers, "draft_decode", bs, s)] = _Wrapper(
                    group, s, self._flashinfer_wrapper(group, s, last_page_len))
        return self._wrappers[key]

    def _flashinfer_wrapper(self, group: _Group, step: int, last_page_len: torch.Tensor) -> Any:
        if group.wrappers is WrapperSet.EAGER:  # flashinfer keeps the plan's buffers (the kv_indices: a view of ours)
            if group.kind == "prefill":
                return self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
            return self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True)
        qo_indptr, kv_indptr = group.meta[: group.lanes + 1], group.kv_indptr(step)
        if group.kind == "prefill":
            return self.fi.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=qo_indptr, paged_kv_indptr_buf=kv_indptr,
                paged_kv_indices_buf=group.kv_indices[step], paged_kv_last_page_len_buf=last_page_len, backend="fa2",
            )
        return self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=kv_indptr,
            paged_kv_indices_buffer=group.kv_indices[step], paged_kv_last_page_len_buffer=last_page_len,
        )

    def _host_seq_lens(self, fb: ForwardBatch) -> list[int]:
        """Every request's seq_len on the host, from the batch's host copy, else read back (a sync)."""
        seq, readback = host_seq_lens(fb, self._chain)
        self.readbacks += readback
        return seq

    def _plan_args(self, fb: ForwardBatch, kind: str, wrappers: WrapperSet) -> _PlanArgs:
        """Host-side lengths from the batch (never under capture)."""
        group = self._entry(wrappers, kind, fb.batch_size).group
        index = pass_plan(fb, kind == "prefill", self._host_seq_lens(fb), self.max_ctx, group.cap, out=self._staging(group))
        return _PlanArgs(index, group.staged)

    def _draft_plan_args(self, fb: ForwardBatch, seq: list[int], steps: int, wrappers: WrapperSet) -> _PlanArgs:
        """Every step's indptr of a draft decode in one staging (flashinfer_plan.draft_decode_plan)."""
        group = self._draft_entry(fb, steps, 0, wrappers).group
        index = draft_decode_plan(seq, fb.spec_info.topk, steps, self.max_ctx, group.cap, out=self._staging(group))
        return _PlanArgs(index, group.staged)

    def _staging(self, group: _Group) -> torch.Tensor:
        """The group's pinned staging buffer, once the group's last plan has uploaded: a host running ahead of the stream
        would overwrite lengths still to be copied, and flashinfer writes each plan of a wrapper into the same pinned
        buffer before its copy (every plan of the group's wrappers starts here, so this one wait covers both)."""
        group.upload_event.synchronize()
        group.staged += 1
        return group.staging

    def _chain(self, T: int, device: torch.device) -> torch.Tensor:
        key = (T, str(device))
        if key not in self._chains:
            self._chains[key] = chain_mask(T).to(device)
        return self._chains[key]

    def _plan(self, entry: _Wrapper, args: _PlanArgs, num_qo_heads: int, key: Optional[tuple] = None, refs: tuple = (),
              replay: bool = False) -> None:
        """Writes the group's buffers (once per args), then plans the step's wrapper: flashinfer's own plan, or before a
        replay its planner alone (`_replan`). The args were staged after the group's last plan uploaded (`_staging`)."""
        group, index = entry.group, args.index
        if not args.written:
            if args.stage != group.staged:
                raise RuntimeError("flashinfer: a plan's host lengths were overwritten in the staging buffer by a later plan "
                                   "of the same wrappers before they were uploaded")
            group.meta.copy_(index.packed, non_blocking=True)
            args.written = True
        if replay:
            self._replan(entry, index, num_qo_heads)
        else:
            common = dict(q_data_type=self.compute_dtype, kv_data_type=self.compute_dtype)
            kv_indices = group.kv_indices[entry.step, : index.totals[entry.step]]  # the buffer itself: flashinfer's copy is a no-op
            last_page_len = torch.ones(group.lanes, dtype=torch.int32)
            if entry.kind == "prefill":
                entry.wrapper.plan(index.qo_indptr(), index.kv_indptr(entry.step), kv_indices, last_page_len,
                                   num_qo_heads, self.num_kv_heads, self.head_dim, 1, causal=True, **common)
            else:
                entry.wrapper.plan(index.kv_indptr(entry.step), kv_indices, last_page_len, num_qo_heads, self.num_kv_heads,
                                   self.head_dim, 1, **common)
        group.upload_event.record()
        entry.plans += 1
        entry.plan_key, entry.plan_refs = key, refs
        self.num_qo_heads = num_qo_heads

    def _replan(self, entry: _Wrapper, index: KvIndexPlan, num_qo_heads: int) -> None:
        """flashinfer's planner on the host lengths, as the engine's fast plans call it before a replay: the wrapper's
        buffers are written already and the captured kernels keep their arguments (CUDA-graph mode fixes the grid), so
        only the work partition in the int workspace changes. Needs a full plan first (its module, its row bound)."""
        w, step, prefill = entry.wrapper, entry.step, entry.kind == "prefill"
        if entry.plans == 0:
            raise RuntimeError("flashinfer: a replay plan of a wrapper never planned (the graph was never warmed up)")
        rows = entry.group.lanes
        if prefill:
            rows = w._max_total_num_rows
            if index.qo_rows > rows:
                raise ValueError(f"flashinfer plan: {index.qo_rows} query rows, the captured wrapper holds {rows}")
        w._plan_info = w._cached_module.plan(
            w._float_workspace_buffer, w._int_workspace_buffer, w._pin_memory_int_workspace_buffer,
            index.qo_indptr(), index.kv_indptr(step), index.kv_lens_host(step), rows, entry.group.lanes,
            num_qo_heads, self.num_kv_heads, 1, True, self.head_dim, self.head_dim, prefill, -1,  # page size, graph mode, window
            -1, False, 0,  # fa2: no fixed split size, split-kv allowed, no co-located CTAs (flashinfer's own plan passes these)
        )

    # ---- the backend interface ----
    def _capturing(self, entry: _Wrapper, what: str) -> bool:
        """Under capture: the warm-up's plan, no new one (a plan is host work)."""
        if graph_record.recording():
            # flashinfer launches its kernels through its own FFI, not the torch dispatcher: a
            # recording graph would replay everything but the attention. Refuse, don't mislead.
            raise graph_record.GraphCaptureError("flashinfer kernels bypass the torch dispatcher; the recording CPU graph "
                                                 "cannot capture them: use the cuda graph backend with flashinfer")
        if not torch.cuda.is_current_stream_capturing():
            return False
        if entry.group.wrappers is not WrapperSet.GRAPH:
            raise RuntimeError(f"flashinfer: capturing {what}, a batch no graph runner named (init_forward_metadata_capture_cuda_graph)")
        if entry.plans == 0:
            raise RuntimeError(f"flashinfer: capturing {what} before any warm-up planned its wrapper")
        return True

    def init_forward_metadata_capture_cuda_graph(self, fb: ForwardBatch) -> None:
        """A graph runner's bucket batch, before its warm-ups: passes over it plan the bucket's graph wrappers."""
        self.graph_batches.add(fb)

    def init_forward_metadata(self, fb: ForwardBatch) -> FlashInferMetadata:
        kind, wrappers = self._kind(fb), self.graph_batches.wrapper_set(fb)
        entry = self._entry(wrappers, kind, fb.batch_size)
        if self._capturing(entry, f"bs={fb.batch_size}"):
            return FlashInferMetadata(entry, None, planned=True)
        return FlashInferMetadata(entry, self._plan_args(fb, kind, wrappers))

    def init_draft_decode_metadata(self, fb: ForwardBatch, locs: torch.Tensor, step: int) -> FlashInferMetadata:
        """One draft-decode step (a decode wrapper per (bucket, step), as the engine's multi-step draft backend keeps one
        per step); locs [bs, topk, steps] are the lanes' draft slots, which the step's kv_indices end with."""
        steps, wrappers = locs.shape[-1], self.graph_batches.wrapper_set(fb)
        entry = self._draft_entry(fb, steps, step, wrappers)
        captured = self._capturing(entry, f"the draft decode bs={fb.batch_size} step {step}")
        args = None if captured else self._draft_plan_args(fb, self._host_seq_lens(fb), steps, wrappers)
        return FlashInferMetadata(entry, args, planned=captured, per_req=fb.spec_info.topk, own=locs.reshape(-1, steps),
                                  own_len=step + 1)

    def _draft_entry(self, fb: ForwardBatch, steps: int, step: int, wrappers: WrapperSet) -> _Wrapper:
        return self._entry(wrappers, "decode", fb.batch_size, fb.batch_size * fb.spec_info.topk, steps, step)

    def init_forward_metadata_replay_cuda_graph(self, fb: ForwardBatch) -> None:
        """Before a replay: re-plan the bucket's wrapper with the live lengths in fb's buffers,
        unless its last plan was a replay plan of the same, unwritten, inputs. A draft-decode
        bucket plans every step's wrapper (its graph holds all the steps)."""
        if self.num_qo_heads is None:
            raise RuntimeError("flashinfer: replay before any plan (the graph was never warmed up)")
        self.graph_batches.require(fb, "flashinfer: a replay plan")
        if isinstance(fb.spec_info, DraftDecodeSpecInfo):
            self.plan_draft_decode_replay(fb)
            return
        entry = self._entry(WrapperSet.GRAPH, self._kind(fb), fb.batch_size)
        key = plan_inputs_key(fb, self.req_pool.req_to_token, self.num_qo_heads)
        if key is not None and key == entry.plan_key:
            entry.replans_skipped += 1
            return
        self.plan_replay(fb, key)

    def plan_replay(self, fb: ForwardBatch, key: Optional[tuple] = None) -> None:
        """Plans the bucket's wrapper for a replay over fb's buffers, whatever its last plan was."""
        kind = self._kind(fb)
        if self.num_qo_heads is None:
            raise RuntimeError("flashinfer: replay before any plan (the graph was never warmed up)")
        refs = (fb.seq_lens, fb.seq_lens_cpu, fb.req_pool_indices, self.req_pool.req_to_token, fb.spec_info)
        graph = WrapperSet.GRAPH
        self._plan(self._entry(graph, kind, fb.batch_size), self._plan_args(fb, kind, graph), self.num_qo_heads, key, refs, replay=True)

    def plan_draft_decode_replay(self, fb: ForwardBatch) -> None:
        """Every step's wrapper of the bucket, from one set of host lengths and one upload of all steps' indptrs (the
        graph's steps write their kv_indices from them, with the draft slots its body assigns)."""
        info: DraftDecodeSpecInfo = fb.spec_info
        steps = fb.out_cache_loc.shape[0] // (fb.batch_size * info.topk)
        args = self._draft_plan_args(fb, self._host_seq_lens(fb), steps, WrapperSet.GRAPH)
        for step in range(steps):
            self._plan(self._draft_entry(fb, steps, step, WrapperSet.GRAPH), args, self.num_qo_heads, replay=True)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch, meta: FlashInferMetadata) -> torch.Tensor:
        """q [N, hq, d], k/v [N, hkv, d] (this pass's tokens) -> [N, hq, d]."""
        self.kv_pool.write(layer, fb.out_cache_loc, k, v)
        if not meta.planned:
            self._plan(meta.entry, meta.args, int(q.shape[1]))
            meta.planned = True
        if not meta.indexed:  # the pass's first layer; under capture, in the graph
            group, step = meta.entry.group, meta.entry.step
            write_kv_indices(group.kv_indptr(step), fb.req_pool_indices, self.req_pool.req_to_token, group.kv_indices[step],
                             meta.per_req, meta.own, meta.own_len)
            meta.indexed = True
        kc, vc = self.kv_pool.k[layer], self.kv_pool.v[layer]
        if kc.dtype != self.compute_dtype:
            kc, vc = kc.to(self.compute_dtype), vc.to(self.compute_dtype)
        o = meta.entry.wrapper.run(q.to(self.compute_dtype).contiguous(), (kc.unsqueeze(1), vc.unsqueeze(1)))
        return o.to(q.dtype)

