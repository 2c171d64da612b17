"""Attention planned on the host per pass, flashinfer's shape in torch ops: the host-planned path on any device.

flashinfer runs on a GPU only, so its plan path (lengths read on the host, indptrs uploaded into a wrapper's fixed
buffers before every replay, the wrapper's row count fixed by its first cuda-graph plan) would never run in CPU CI.
This backend has that shape with torch kernels, and flashinfer's plan code (runners.attention.flashinfer_plan):

- the plan (host work, never inside a graph) reads every lane's lengths from the batch's host copies
  (`seq_lens_cpu`; a verify batch's `custom_mask_cpu`, which must be a chain), writes qo_indptr and kv_indptr into
  the wrapper's fixed int32 buffer, and is refused past the rows a graph wrapper's first plan fixed, as flashinfer
  refuses them. Eager passes plan wrappers of their own; a graph runner names its bucket batches first
  (`init_forward_metadata_capture_cuda_graph`), and before each replay the runner calls
  `init_forward_metadata_replay_cuda_graph` with the bucket's batch, whose buffers hold the replay's lanes by then.
  A replay plan whose inputs were not written since the last one is skipped (`plan_inputs_key`), as flashinfer's;
- the capture run plans nothing: its kernels read the buffers the warm-up's plan wrote, and at replay what the
  replay plan wrote;
- the kernels (static shapes, graph-safe): the pass's first layer writes the flat kv_indices from the kv_indptr
  and the request rows (flashinfer_kv_indices' job, here in torch ops, so a recording CPU graph captures it);
  every layer then attends query row i of a lane of qo_len rows to keys j < kv_len with j <= kv_len - qo_len + i,
  the causal rule flashinfer applies: only what the plan says reaches the kernel, never seq_lens or positions.

Where a plan is wrong the kernel reads other keys than the torch reference (runners.attention.torch_ref), which reads
lengths on the device: the eager-vs-graph and cross-layout properties see it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

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
from runners.attention.torch_ref import attend
from runners.batch import ForwardBatch, ForwardMode
from runners.eagle_draft import DraftDecodeSpecInfo
from runners.graph import record as graph_record
from runners.memory import ReqToTokenPool, TokenToKVPool
from runners.verify import chain_mask


@dataclass
class PlannedWrapper:
    """A wrapper's device buffers (flashinfer's qo_indptr / kv_indptr / kv_indices buffers) and its plan state."""

    wrappers: WrapperSet
    kind: str  # "prefill" | "decode" | "draft_decode"
    lanes: int
    steps: int  # a draft decode's steps share one buffer set, as flashinfer's one wrapper group per bucket
    keys: int  # keys a lane may read: a request row, and a draft decode's own slots
    meta: torch.Tensor  # int32: qo_indptr [lanes + 1], then kv_indptr [lanes + 1] of each step
    kv_indices: torch.Tensor  # int32 [steps, cap + 1]: the last entry takes the writes of masked key positions
    max_rows: Optional[int] = None  # a graph wrapper's query rows, fixed by its first plan (flashinfer's cuda-graph mode)
    plans: int = 0
    replans_skipped: int = 0
    plan_key: Optional[tuple] = None  # what the last replay plan read (flashinfer_plan.plan_inputs_key)
    plan_refs: tuple = ()  # keeps the keyed tensors alive, so no new tensor takes their storage address

    @property
    def cap(self) -> int:
        return self.kv_indices.shape[1] - 1

    def indptr(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.lanes + 1
        return self.meta[:n], self.meta[(1 + step) * n: (2 + step) * n]


@dataclass
class PlannedMetadata:
    wrapper: PlannedWrapper
    step: int = 0
    per_req: int = 1  # lanes per request (a draft decode's topk)
    own: Optional[torch.Tensor] = None  # a draft decode's slots [lanes, steps]; the step's lanes read their first own_len
    own_len: int = 0
    indexed: bool = False  # the pass's kv_indices are written (by its first layer)


class TorchPlannedAttnBackend:
    name = "torch_planned"

    def __init__(self, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool):
        self.req_pool, self.kv_pool = req_pool, kv_pool
        self.device = kv_pool.k[0].device
        self.max_ctx = int(req_pool.req_to_token.shape[1])
        self.graph_batches = GraphBatches()
        self.readbacks = 0  # plans that read lengths back from the device (a sync on a GPU)
        self._wrappers: dict[tuple, PlannedWrapper] = {}
        self._chains: dict[tuple[int, str], torch.Tensor] = {}

    # ---- wrappers and plans (host work) ----
    def _wrapper(self, wrappers: WrapperSet, kind: str, lanes: int, steps: int = 1) -> PlannedWrapper:
        key = (wrappers, kind, lanes, steps)
        if key not in self._wrappers:
            keys = self.max_ctx + (steps if kind == "draft_decode" else 0)
            cap = max(lanes, 1) * keys
            i32 = dict(dtype=torch.int32, device=self.device)
            self._wrappers[key] = PlannedWrapper(wrappers, kind, lanes, steps, keys, torch.zeros(packed_len(lanes, steps), **i32),
                                                 torch.zeros(steps, cap + 1, **i32))
        return self._wrappers[key]

    def _chain(self, T: int, device: torch.device) -> torch.Tensor:
        key = (T, str(device))
        if key not in self._chains:
            self._chains[key] = chain_mask(T).to(device)
        return self._chains[key]

    def _host_seq_lens(self, fb: ForwardBatch) -> list[int]:
        seq, readback = host_seq_lens(fb, self._chain)
        self.readbacks += readback
        return seq

    def _plan(self, w: PlannedWrapper, index: KvIndexPlan) -> None:
        """Uploads the plan's indptrs into the wrapper's buffer, outside any graph; a graph wrapper keeps the rows of its
        first plan, as flashinfer's cuda-graph mode does."""
        if w.wrappers is WrapperSet.GRAPH:
            if w.max_rows is None:
                w.max_rows = index.qo_rows
            elif index.qo_rows > w.max_rows:
                raise ValueError(f"The total number of rows in qo_indptr {index.qo_rows} in cuda graph mode cannot exceed the number "
                                 f"of rows set during initialization {w.max_rows} ({w.kind} wrapper of {w.lanes} lanes)")
        w.meta.copy_(index.packed)
        w.plans += 1
        w.plan_key, w.plan_refs = None, ()

    def _capturing(self, w: PlannedWrapper, what: str) -> bool:
        """Under capture: the warm-up's plan, no new one (a plan is host work)."""
        if not (graph_record.recording() or (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
            return False
        if w.wrappers is not WrapperSet.GRAPH:
            raise RuntimeError(f"torch_planned: capturing {what}, a batch no graph runner named (init_forward_metadata_capture_cuda_graph)")
        if w.plans == 0:
            raise RuntimeError(f"torch_planned: capturing {what} before any warm-up planned its wrapper")
        return True

    def _pass_wrapper(self, fb: ForwardBatch, wrappers: WrapperSet) -> tuple[PlannedWrapper, bool]:
        prefill = fb.forward_mode is not ForwardMode.DECODE
        return self._wrapper(wrappers, "prefill" if prefill else "decode", fb.batch_size), prefill

    def _draft_wrapper(self, fb: ForwardBatch, steps: int, wrappers: WrapperSet) -> PlannedWrapper:
        return self._wrapper(wrappers, "draft_decode", fb.batch_size * fb.spec_info.topk, steps)

    def _plan_pass(self, fb: ForwardBatch, w: PlannedWrapper, prefill: bool) -> None:
        self._plan(w, pass_plan(fb, prefill, self._host_seq_lens(fb), self.max_ctx, w.cap))

    def _plan_draft(self, fb: ForwardBatch, w: PlannedWrapper) -> None:
        self._plan(w, draft_decode_plan(self._host_seq_lens(fb), fb.spec_info.topk, w.steps, self.max_ctx, w.cap))

    # ---- the backend interface ----
    def init_forward_metadata_capture_cuda_graph(self, fb: ForwardBatch) -> None:
        """A graph runner's bucket batch, before its warm-ups: passes over it plan the bucket's graph wrapper."""
        self.graph_batches.add(fb)

    def init_forward_metadata(self, fb: ForwardBatch) -> PlannedMetadata:
        w, prefill = self._pass_wrapper(fb, self.graph_batches.wrapper_set(fb))
        if not self._capturing(w, f"bs={fb.batch_size}"):
            self._plan_pass(fb, w, prefill)
        return PlannedMetadata(w)

    def init_draft_decode_metadata(self, fb: ForwardBatch, locs: torch.Tensor, step: int) -> PlannedMetadata:
        """Step `step` of a draft decode (locs [bs, topk, steps]): one plan of every step's indptrs, at step 0."""
        steps = locs.shape[-1]
        w = self._draft_wrapper(fb, steps, self.graph_batches.wrapper_set(fb))
        if not self._capturing(w, f"the draft decode bs={fb.batch_size} step {step}") and step == 0:
            self._plan_draft(fb, w)
        return PlannedMetadata(w, step, fb.spec_info.topk, locs.reshape(-1, steps), step + 1)

    def init_forward_metadata_replay_cuda_graph(self, fb: ForwardBatch) -> None:
        """Before a replay: plan the bucket's graph wrapper from the replay's own buffers (fb's tensors and host mirrors
        hold the live lanes by now), unless nothing it reads was written since its last replay plan."""
        key = plan_inputs_key(fb, self.req_pool.req_to_token, 0)
        w = self._replay_wrapper(fb)
        if key is not None and key == w.plan_key:
            w.replans_skipped += 1
            return
        self.plan_replay(fb, key)

    def plan_replay(self, fb: ForwardBatch, key: Optional[tuple] = None) -> None:
        """Plans the bucket's graph wrapper for a replay over fb's buffers, whatever its last plan was."""
        w = self._replay_wrapper(fb)
        if isinstance(fb.spec_info, DraftDecodeSpecInfo):
            self._plan_draft(fb, w)
        else:
            self._plan_pass(fb, w, fb.forward_mode is not ForwardMode.DECODE)
        w.plan_key, w.plan_refs = key, (fb.seq_lens, fb.seq_lens_cpu, fb.req_pool_indices, self.req_pool.req_to_token, fb.spec_info)

    def _replay_wrapper(self, fb: ForwardBatch) -> PlannedWrapper:
        self.graph_batches.require(fb, "torch_planned: a replay plan")
        if isinstance(fb.spec_info, DraftDecodeSpecInfo):
            w = self._draft_wrapper(fb, fb.out_cache_loc.shape[0] // (fb.batch_size * fb.spec_info.topk), WrapperSet.GRAPH)
        else:
            w = self._pass_wrapper(fb, WrapperSet.GRAPH)[0]
        if w.plans == 0:
            raise RuntimeError("torch_planned: a replay plan of a wrapper never planned (the graph was never warmed up)")
        return w

    # ---- the kernels: torch ops over the plan's buffers (graph-safe: static shapes, no host reads) ----
    def _write_kv_indices(self, fb: ForwardBatch, meta: PlannedMetadata) -> None:
        """kv_indices[kv_indptr[n] + j] = lane n's j-th key slot: its request row's first kv_len - own_len slots, then
        its own draft slots; positions past a lane's length write the dump entry at the end."""
        w = meta.wrapper
        _, kv_indptr = w.indptr(meta.step)
        start, length = kv_indptr[:-1].long(), (kv_indptr[1:] - kv_indptr[:-1]).long()
        rows = fb.req_pool_indices[torch.arange(w.lanes, device=self.device) // meta.per_req]
        table = self.req_pool.req_to_token
        j = torch.arange(w.keys, device=self.device)
        prefix = (length - meta.own_len)[:, None]
        slot = table[rows[:, None], j.clamp(max=table.shape[1] - 1)[None, :]]
        if meta.own is not None and meta.own_len:
            own = meta.own[torch.arange(w.lanes, device=self.device)[:, None], (j[None, :] - prefix).clamp(0, meta.own.shape[1] - 1)]
            slot = torch.where(j[None, :] < prefix, slot, own)
        at = torch.where(j[None, :] < length[:, None], start[:, None] + j[None, :], w.cap)
        w.kv_indices[meta.step].index_put_((at.flatten(),), slot.flatten().to(torch.int32))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch, meta: PlannedMetadata) -> torch.Tensor:
        """q [N, hq, d], k/v [N, hkv, d] (this pass's tokens) -> [N, hq, d]."""
        self.kv_pool.write(layer, fb.out_cache_loc, k, v)
        w, n = meta.wrapper, q.shape[0]
        if n == 0 or w.lanes == 0:
            return torch.zeros_like(q)
        if not meta.indexed:  # the pass's first layer; under capture, in the graph
            self._write_kv_indices(fb, meta)
            meta.indexed = True
        qo_indptr, kv_indptr = (t.long() for t in w.indptr(meta.step))
        row = torch.arange(n, device=q.device)
        lane = torch.searchsorted(qo_indptr[1:], row, right=True).clamp_(max=w.lanes - 1)  # the lane whose rows hold `row`
        qo_len = qo_indptr[lane + 1] - qo_indptr[lane]
        kv_start, kv_len = kv_indptr[lane], kv_indptr[lane + 1] - kv_indptr[lane]
        j = torch.arange(w.keys, device=q.device)
        last = (kv_len - qo_len + row - qo_indptr[lane])[:, None]  # the causal bound: the row's position in its lane's keys
        key_mask = (j[None, :] < kv_len[:, None]) & (j[None, :] <= last)
        kv_slots = w.kv_indices[meta.step][(kv_start[:, None] + j[None, :]).clamp(max=w.cap)].long()
        return attend(q, self.kv_pool.k[layer], self.kv_pool.v[layer], kv_slots, key_mask)
