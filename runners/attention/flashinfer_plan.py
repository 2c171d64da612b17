"""What a host-planned attention backend reads and builds, apart from its kernels: flashinfer's plan, shared with the
CPU backend of the same shape (runners.attention.torch_planned), so the CPU suite runs this code.

A plan needs every lane's KV length on the host. The batch's host copies (`seq_lens_cpu`, a verify
batch's `custom_mask_cpu`: the scheduler knows both on the host, and the graph runners keep host
mirrors of their buffers) give them without a device sync; a batch without them is read back.

Which wrappers a pass plans: a graph bucket's wrappers have fixed buffers, whose addresses its graph
captured, and flashinfer fixes a cuda-graph wrapper's row count at its first plan; an eager pass (a
prompt prefill of any length) plans wrappers of its own, as SGLang keeps its eager prefill and decode
wrappers apart from the ones it creates per captured batch size. A graph runner names the batches it
captures with (`init_forward_metadata_capture_cuda_graph`, before the warm-ups): `GraphBatches`.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from itertools import accumulate
from typing import Callable, Optional

import numpy as np
import torch

from runners.attention.kinds import TREE_MASK_UNSUPPORTED
from runners.batch import EagleVerifyInput, ForwardBatch


class WrapperSet(StrEnum):
    """Which wrappers a pass plans (SGLang: the eager wrappers, or the ones made for a captured batch size)."""

    EAGER = "eager"  # planned per pass, any row count (flashinfer: use_cuda_graph=False)
    GRAPH = "graph"  # a captured bucket's: fixed buffers, the row count fixed by the first plan


class GraphBatches:
    """The batches graph runners captured with, by their seq_lens buffer (the body's derived batches, a draft decode
    step's `replace(fb, ...)`, keep it): a pass over one of them plans its bucket's graph wrappers, any other an
    eager one."""

    def __init__(self) -> None:
        self._held: dict[int, torch.Tensor] = {}  # id -> the tensor, kept so that no other tensor takes its id

    def add(self, fb: ForwardBatch) -> None:
        self._held[id(fb.seq_lens)] = fb.seq_lens

    def wrapper_set(self, fb: ForwardBatch) -> WrapperSet:
        return WrapperSet.GRAPH if self._held.get(id(fb.seq_lens)) is fb.seq_lens else WrapperSet.EAGER

    def require(self, fb: ForwardBatch, what: str) -> None:
        if self.wrapper_set(fb) is not WrapperSet.GRAPH:
            raise RuntimeError(f"{what}: a batch no graph runner captured with (init_forward_metadata_capture_cuda_graph)")


def plan_sources(fb: ForwardBatch) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The tensors a plan reads the lengths (and, for a verify batch, the tree mask) from: the host
    copies when the batch has all it needs on the host, else the device tensors (read back: a sync)."""
    tree = fb.spec_info if isinstance(fb.spec_info, EagleVerifyInput) else None
    host_seq = getattr(fb, "seq_lens_cpu", None)
    host_mask = None if tree is None else tree.custom_mask_cpu
    if host_seq is not None and (tree is None or host_mask is not None):
        return host_seq, host_mask
    return fb.seq_lens, None if tree is None else tree.custom_mask


def _written(t: torch.Tensor) -> Optional[tuple[int, int]]:
    """Where a tensor's storage is and how often it was written in place (views share the count)."""
    try:
        return t.untyped_storage().data_ptr(), t._version
    except RuntimeError:  # an inference tensor keeps no version counter: never treat it as unchanged
        return None


def plan_inputs_key(fb: ForwardBatch, req_to_token: torch.Tensor, num_qo_heads: int) -> Optional[tuple]:
    """What a replay plan reads, by storage and write count: equal keys mean no in-place write
    (a buffer fill, a copy-in, the scheduler's req_to_token rows) reached those tensors in between.

    The count only sees writes made through torch; a replayed CUDA graph's writes it does not
    see, so this holds because no captured body writes seq_lens, req_pool_indices or
    req_to_token (the graphs read them). None: unknown, plan anyway.
    """
    seq, mask = plan_sources(fb)
    read = [seq, fb.req_pool_indices, req_to_token] + ([mask] if mask is not None else [])
    parts = tuple(_written(t) for t in read)
    if any(p is None for p in parts):
        return None
    return (fb.forward_mode, fb.batch_size, tuple(fb.extend_seq_lens_cpu), num_qo_heads, *parts)


@dataclass(frozen=True)
class KvIndexPlan:
    """The host half of a plan of one wrapper group (a wrapper, or the draft decode's one per step): every step's
    indptrs, packed as the group's device buffer holds them, so that one host-to-device copy writes them all (the
    kv_indices are then written on the device from them: runners/attention/flashinfer_kv_indices.py).

    packed (int32): qo_indptr [lanes + 1], then the kv_indptr [lanes + 1] of steps 0 .. steps - 1.
    """

    packed: torch.Tensor
    lanes: int
    steps: int
    kv_lens: np.ndarray  # int32 [steps, lanes]: every lane's KV length at each step
    totals: list[int]  # every step's KV slots (kv_indptr[-1])
    qo_rows: int  # query rows (qo_indptr[-1])

    def qo_indptr(self) -> torch.Tensor:
        return self.packed[: self.lanes + 1]

    def kv_indptr(self, step: int) -> torch.Tensor:
        start = (1 + step) * (self.lanes + 1)
        return self.packed[start: start + self.lanes + 1]

    def kv_lens_host(self, step: int) -> torch.Tensor:
        return torch.from_numpy(self.kv_lens[step])


def packed_len(lanes: int, steps: int) -> int:
    return (1 + steps) * (lanes + 1)


def kv_index_plan(qo_lens: list[int], prefix: list[int], width: int, cap: int, steps: int = 1, draft_slots: int = 0,
                  out: Optional[torch.Tensor] = None) -> KvIndexPlan:
    """Lane n reads the first prefix[n] slots of its request's req_to_token row (`width` wide). In a draft decode
    (draft_slots > 0) each lane's own draft slots follow, and at step s the lane reads its first s + 1 of them after its
    prefix. Every step's indptr is written, into `out` (a host int32 buffer, e.g. the group's pinned staging) when
    given. Host array work only."""
    lanes = len(prefix)
    if len(qo_lens) != lanes:
        raise ValueError(f"host plan: {len(qo_lens)} query lengths and {lanes} lanes")
    if steps < 1 or (draft_slots and steps > draft_slots):
        raise ValueError(f"host plan: {steps} steps, {draft_slots} draft slots per lane")
    if lanes and not 0 <= min(prefix) <= max(prefix) <= width:
        raise ValueError(f"host plan: prefix lengths {prefix} outside a request row of {width} slots")
    own = range(1, steps + 1) if draft_slots else [0] * steps
    rows = [[q + o for q in prefix] for o in own]  # plain Python: a few dozen lanes, where numpy's per-call cost dominates
    totals = [sum(row) for row in rows]
    if lanes and max(totals) > cap:
        raise ValueError(f"host plan: {max(totals)} KV slots in one step, the buffer holds {cap}")
    n = packed_len(lanes, steps)
    if out is None:
        out = torch.empty(n, dtype=torch.int32)
    elif out.dtype != torch.int32 or out.device.type != "cpu" or out.numel() < n:
        raise ValueError(f"host plan: a host int32 buffer of {n} entries, got {out.dtype} [{out.numel()}] on {out.device}")
    indptrs = list(accumulate(qo_lens, initial=0))
    qo_rows = indptrs[-1]
    for row in rows:
        indptrs += accumulate(row, initial=0)
    out[:n].numpy()[:] = indptrs
    kv_lens = np.array(rows, dtype=np.int32).reshape(steps, lanes)
    return KvIndexPlan(out[:n], lanes, steps, kv_lens, totals, qo_rows)


# ---- a pass's lengths, and its plan ----

def host_seq_lens(fb: ForwardBatch, chain: Callable[[int, torch.device], torch.Tensor]) -> tuple[list[int], bool]:
    """Every request's seq_len on the host (and whether it was read back from the device: a sync); a verify batch's
    tree must be a chain (`chain(T, device)`: its mask), checked in the same read: a host plan's causal mask is the
    chain's, never a tree's."""
    bs = fb.batch_size
    seq_src, mask_src = plan_sources(fb)
    readback = seq_src is fb.seq_lens  # not the host copy (on CPU a plain read; on a GPU a sync)
    if mask_src is None:
        return seq_src[:bs].tolist(), readback
    want = chain(fb.spec_info.draft_token_num, mask_src.device)
    if mask_src.device.type == "cpu":  # host copies: numpy, no tensor ops
        if (mask_src[:bs].numpy() != want.numpy()).any():
            raise NotImplementedError(TREE_MASK_UNSUPPORTED)
        return seq_src[:bs].tolist(), readback
    not_chain = (mask_src[:bs] != want).any().view(1).to(seq_src.dtype)
    *seq, refused = torch.cat((seq_src[:bs], not_chain)).tolist()  # one read (a sync only from the device)
    if refused:
        raise NotImplementedError(TREE_MASK_UNSUPPORTED)
    return seq, readback


def pass_plan(fb: ForwardBatch, prefill: bool, seq: list[int], max_ctx: int, cap: int,
              out: Optional[torch.Tensor] = None) -> KvIndexPlan:
    """A prefill (extend, verify, draft-extend) or decode pass: lane n's queries are its extend tokens (one in a
    decode), its keys the first kv_len of its request row. A lane's kv_len is at least its query count, so a padded
    lane (seq_len = the fill value, below T) still gives every row a key (an all-masked row could turn into NaN)."""
    bs = fb.batch_size
    qo = list(fb.extend_seq_lens_cpu) if prefill and fb.extend_seq_lens_cpu else [1] * bs
    if len(qo) != bs or sum(qo) != fb.input_ids.shape[0]:
        raise ValueError(f"host plan: extend lengths {qo} do not cover the batch's {fb.input_ids.shape[0]} tokens")
    kv = [max(1, min(max(s, q), max_ctx)) for s, q in zip(seq, qo, strict=True)]
    return kv_index_plan(qo, kv, max_ctx, cap, out=out)


def draft_decode_plan(seq: list[int], topk: int, steps: int, max_ctx: int, cap: int,
                      out: Optional[torch.Tensor] = None) -> KvIndexPlan:
    """Lane (b, t) at draft step s: its request's prefix (seq_len keys), then its own slots of steps 0..s; every
    step's indptr in one plan."""
    prefix = [min(s, max_ctx) for s in seq for _ in range(topk)]
    return kv_index_plan([1] * len(prefix), prefix, max_ctx, cap, steps, steps, out=out)
