"""flashinfer attention over the paged (page size 1) KV cache, with the CUDA-graph-safe plan.

Draft-extend (and any multi-token extend) runs BatchPrefillWithPagedKVCacheWrapper with a
causal mask; one-token-per-request DECODE runs BatchDecodeWithPagedKVCacheWrapper (tensor
cores on, so both use the same fa2 module and the first run JIT-compiles one module).

The plan is host work (it reads the lengths on the host and writes a work partition
into the wrapper's int workspace), so it can never run inside a graph. As the engines do:
- one wrapper per (kind, batch size), built with `use_cuda_graph=True` and fixed buffers
  for qo_indptr / kv_indptr / kv_indices / last_page_len, so a graph captured with it
  reads those buffers at fixed addresses;
- eager steps and graph warm-ups plan with the batch's live metadata before the kernel
  runs; the capture run does not plan (it records the kernels of the plan its warm-up
  left);
- before every replay the graph runner calls `init_forward_metadata_replay_cuda_graph(fb)`
  with the bucket's batch, whose tensors hold the live lanes by then: the wrapper is
  re-planned with the live seq_lens / req_pool_indices (flashinfer always splits the KV
  in CUDA-graph mode, so the replayed grid does not depend on the lengths);
- that re-plan is skipped when nothing it reads was written since the wrapper's last plan
  (`plan_inputs_key`): the multi-layer draft-extend steps of an iteration share one buffer
  set and one wrapper per bucket, and only the chain inputs change between steps, so the
  steps' graphs are planned once per iteration, at the first step (the engine stages the
  metadata once in the multi-step runner's prepare for the same reason). A plan is a host
  round trip (a device sync, the work partition, its upload), which a per-step plan would
  pay once per draft layer.

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

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Optional

import torch

from runners import graph_record
from runners.attention.flashinfer_plan import paged_kv_indices, plan_inputs_key, plan_sources
from runners.batch import ForwardBatch, ForwardMode
from runners.eagle_draft import DraftDecodeSpecInfo, assign_draft_cache_locs
from runners.memory import ReqToTokenPool, TokenToKVPool
from runners.verify import chain_mask

TREE_MASK_UNSUPPORTED = ("the flashinfer backend does not apply the verify tree mask (a TARGET_VERIFY batch's custom_mask): "
                         "the speculative loop verifies with the torch or triton backend")

SUPPORTED_HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass
class _Wrapper:
    kind: str  # "prefill" | "decode"
    lanes: int  # the wrapper's fixed batch (requests; draft-decode lanes)
    wrapper: Any
    qo_indptr: Optional[torch.Tensor]
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    plans: int = 0
    replans_skipped: int = 0
    plan_key: Optional[tuple] = None  # what the last plan read (plan_inputs_key); None: an eager or warm-up plan
    plan_refs: tuple = ()  # keeps the keyed tensors alive, so no new tensor can take their storage address


@dataclass
class _PlanArgs:
    qo_indptr: torch.Tensor  # host int32 [lanes + 1]
    kv_indptr: torch.Tensor  # host int32 [lanes + 1]
    kv_indices: torch.Tensor  # device int32 [kv_indptr[-1]]
    last_page_len: torch.Tensor  # host int32 [lanes]


@dataclass
class FlashInferMetadata:
    entry: _Wrapper
    args: Optional[_PlanArgs]  # None under capture: the kernels use the warm-up's plan
    planned: bool = False
    extra: dict = field(default_factory=dict)


class FlashInferAttnBackend:
    name = "flashinfer"

    def __init__(self, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool):
        import flashinfer  # the optional extra; imported only when the backend is built

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
        self._chains: dict[tuple[int, str], torch.Tensor] = {}  # the chain mask of T nodes, per device

    # ---- wrappers and plans ----
    @staticmethod
    def _kind(fb: ForwardBatch) -> str:
        return "decode" if fb.forward_mode is ForwardMode.DECODE else "prefill"

    def _entry(self, kind: str, bs: int, lanes: Optional[int] = None, step: Optional[int] = None, extra_keys: int = 0) -> _Wrapper:
        """The wrapper of (kind, bucket) or, for the draft decode, of (bucket, step) over `lanes` lanes,
        each reading at most max_ctx + extra_keys keys."""
        key = (kind, bs) if step is None else ("draft_decode", bs, step)
        if key not in self._wrappers:
            lanes = bs if lanes is None else lanes
            i32 = dict(dtype=torch.int32, device=self.device)
            kv_indptr = torch.zeros(lanes + 1, **i32)
            kv_indices = torch.zeros(max(lanes, 1) * (self.max_ctx + extra_keys), **i32)
            last_page_len = torch.ones(lanes, **i32)
            if kind == "prefill":
                qo_indptr = torch.zeros(lanes + 1, **i32)
                w = self.fi.BatchPrefillWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=qo_indptr, paged_kv_indptr_buf=kv_indptr,
                    paged_kv_indices_buf=kv_indices, paged_kv_last_page_len_buf=last_page_len, backend="fa2",
                )
            else:
                qo_indptr = None
                w = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=kv_indptr,
                    paged_kv_indices_buffer=kv_indices, paged_kv_last_page_len_buffer=last_page_len,
                )
            self._wrappers[key] = _Wrapper(kind, lanes, w, qo_indptr, kv_indptr, kv_indices, last_page_len)
        return self._wrappers[key]

    def _host_seq_lens(self, fb: ForwardBatch) -> list[int]:
        """Every request's seq_len on the host, from the batch's host copy, else read back (a sync);
        a verify batch's tree must be a chain (checked in the same read)."""
        bs = fb.batch_size
        seq_src, mask_src = plan_sources(fb)
        if seq_src.device.type != "cpu":
            self.readbacks += 1
        if mask_src is None:
            return seq_src[:bs].tolist()
        chain = self._chain(fb.spec_info.draft_token_num, mask_src.device)
        not_chain = (mask_src[:bs] != chain).any().view(1).to(seq_src.dtype)
        *seq, refused = torch.cat((seq_src[:bs], not_chain)).tolist()  # one read (a sync only from the device)
        if refused:
            raise NotImplementedError(TREE_MASK_UNSUPPORTED)
        return seq

    def _plan_args(self, fb: ForwardBatch, kind: str) -> _PlanArgs:
        """Host-side lengths from the batch (never under capture)."""
        bs = fb.batch_size
        qo = list(fb.extend_seq_lens_cpu) if kind == "prefill" and fb.extend_seq_lens_cpu else [1] * bs
        if len(qo) != bs or sum(qo) != fb.input_ids.shape[0]:
            raise ValueError(f"flashinfer plan: extend lengths {qo} do not cover the batch's {fb.input_ids.shape[0]} tokens")
        seq = self._host_seq_lens(fb)
        kv = [max(1, min(max(s, q), self.max_ctx)) for s, q in zip(seq, qo, strict=True)]
        kv_indices = paged_kv_indices(self.req_pool.req_to_token, fb.req_pool_indices[:bs], kv)
        return _args(qo, kv, kv_indices)

    def _draft_plan_args(self, fb: ForwardBatch, seq: list[int], locs: torch.Tensor, step: int) -> _PlanArgs:
        """Lane (b, t) at draft step `step`: its request's prefix (seq_len keys), then its own slots of steps 0..step."""
        topk = fb.spec_info.topk
        n = fb.batch_size * topk
        prefix = [min(s, self.max_ctx) for s in seq for _ in range(topk)]
        rows = fb.req_pool_indices[: fb.batch_size].repeat_interleave(topk)
        kv_indices = paged_kv_indices(self.req_pool.req_to_token, rows, prefix, locs.reshape(n, -1), step + 1)
        return _args([1] * n, [p + step + 1 for p in prefix], kv_indices)

    def _chain(self, T: int, device: torch.device) -> torch.Tensor:
        key = (T, str(device))
        if key not in self._chains:
            self._chains[key] = chain_mask(T).to(device)
        return self._chains[key]

    def _plan(self, entry: _Wrapper, args: _PlanArgs, num_qo_heads: int, key: Optional[tuple] = None, refs: tuple = ()) -> None:
        common = dict(q_data_type=self.compute_dtype, kv_data_type=self.compute_dtype)
        if entry.kind == "prefill":
            entry.wrapper.plan(
                args.qo_indptr, args.kv_indptr, args.kv_indices, args.last_page_len,
                num_qo_heads, self.num_kv_heads, self.head_dim, 1, causal=True, **common,
            )
        else:
            entry.wrapper.plan(
                args.kv_indptr, args.kv_indices, args.last_page_len, num_qo_heads, self.num_kv_heads, self.head_dim, 1, **common,
            )
        entry.plans += 1
        entry.plan_key, entry.plan_refs = key, refs
        self.num_qo_heads = num_qo_heads

    # ---- the backend interface ----
    def _capturing(self, entry: _Wrapper, what: str) -> Optional[FlashInferMetadata]:
        """Under capture: the warm-up's plan, no new one (a plan is host work)."""
        if graph_record.recording():
            # flashinfer launches its kernels through its own FFI, not the torch dispatcher: a
            # recording graph would replay everything but the attention. Refuse, don't mislead.
            raise graph_record.GraphCaptureError("flashinfer kernels bypass the torch dispatcher; the recording CPU graph "
                                                 "cannot capture them: use the cuda graph backend with flashinfer")
        if not torch.cuda.is_current_stream_capturing():
            return None
        if entry.plans == 0:
            raise RuntimeError(f"flashinfer: capturing {what} before any warm-up planned its wrapper")
        return FlashInferMetadata(entry, None, planned=True)

    def init_forward_metadata(self, fb: ForwardBatch) -> FlashInferMetadata:
        kind = self._kind(fb)
        entry = self._entry(kind, fb.batch_size)
        return self._capturing(entry, f"bs={fb.batch_size}") or FlashInferMetadata(entry, self._plan_args(fb, kind))

    def init_draft_decode_metadata(self, fb: ForwardBatch, locs: torch.Tensor, step: int) -> FlashInferMetadata:
        """One draft-decode step (a decode wrapper per (bucket, step), as the engine's multi-step draft
        backend keeps one per step); locs [bs, topk, steps] are the lanes' draft slots."""
        entry = self._draft_entry(fb, locs.shape[-1], step)
        captured = self._capturing(entry, f"the draft decode bs={fb.batch_size} step {step}")
        return captured or FlashInferMetadata(entry, self._draft_plan_args(fb, self._host_seq_lens(fb), locs, step))

    def _draft_entry(self, fb: ForwardBatch, steps: int, step: int) -> _Wrapper:
        return self._entry("decode", fb.batch_size, fb.batch_size * fb.spec_info.topk, step, extra_keys=steps)

    def init_forward_metadata_replay_cuda_graph(self, fb: ForwardBatch) -> None:
        """Before a replay: re-plan the bucket's wrapper with the live lengths in fb's buffers,
        unless its last plan was a replay plan of the same, unwritten, inputs. A draft-decode
        bucket plans every step's wrapper (its graph holds all the steps)."""
        if self.num_qo_heads is None:
            raise RuntimeError("flashinfer: replay before any plan (the graph was never warmed up)")
        if isinstance(fb.spec_info, DraftDecodeSpecInfo):
            self.plan_draft_decode_replay(fb)
            return
        entry = self._entry(self._kind(fb), fb.batch_size)
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
        self._plan(self._entry(kind, fb.batch_size), self._plan_args(fb, kind), self.num_qo_heads, key, refs)

    def plan_draft_decode_replay(self, fb: ForwardBatch) -> None:
        """Every step's wrapper of the bucket, from one set of host lengths. The slots are looked up
        here as the graph's body will (its out_cache_loc still holds the last replay's)."""
        info: DraftDecodeSpecInfo = fb.spec_info
        bs, steps = fb.batch_size, fb.out_cache_loc.shape[0] // (fb.batch_size * info.topk)
        seq = self._host_seq_lens(fb)
        locs = assign_draft_cache_locs(self.req_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, info.topk, steps,
                                       torch.empty_like(fb.out_cache_loc)).view(bs, info.topk, steps)
        for step in range(steps):
            self._plan(self._draft_entry(fb, steps, step), self._draft_plan_args(fb, seq, locs, step), self.num_qo_heads)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch, meta: FlashInferMetadata) -> torch.Tensor:
        """q [N, hq, d], k/v [N, hkv, d] (this pass's tokens) -> [N, hq, d]."""
        self.kv_pool.write(layer, fb.out_cache_loc, k, v)
        if not meta.planned:
            self._plan(meta.entry, meta.args, int(q.shape[1]))
            meta.planned = True
        kc, vc = self.kv_pool.k[layer], self.kv_pool.v[layer]
        if kc.dtype != self.compute_dtype:
            kc, vc = kc.to(self.compute_dtype), vc.to(self.compute_dtype)
        o = meta.entry.wrapper.run(q.to(self.compute_dtype).contiguous(), (kc.unsqueeze(1), vc.unsqueeze(1)))
        return o.to(q.dtype)


def _args(qo: list[int], kv: list[int], kv_indices: torch.Tensor) -> _PlanArgs:
    i32 = dict(dtype=torch.int32)
    return _PlanArgs(torch.tensor(list(accumulate(qo, initial=0)), **i32), torch.tensor(list(accumulate(kv, initial=0)), **i32), kv_indices,
                     torch.ones(len(kv), **i32))
