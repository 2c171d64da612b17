"""What a flashinfer plan reads and builds, apart from flashinfer itself (so the CPU can test it).

A plan needs every lane's KV length on the host. The batch's host copies (`seq_lens_cpu`, a verify
batch's `custom_mask_cpu`: the scheduler knows both on the host, and the graph runners keep host
mirrors of their buffers) give them without a device sync; a batch without them is read back.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Optional

import numpy as np
import torch

from runners.batch import EagleVerifyInput, ForwardBatch


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
        raise ValueError(f"flashinfer plan: {len(qo_lens)} query lengths and {lanes} lanes")
    if steps < 1 or (draft_slots and steps > draft_slots):
        raise ValueError(f"flashinfer plan: {steps} steps, {draft_slots} draft slots per lane")
    if lanes and not 0 <= min(prefix) <= max(prefix) <= width:
        raise ValueError(f"flashinfer plan: prefix lengths {prefix} outside a request row of {width} slots")
    own = range(1, steps + 1) if draft_slots else [0] * steps
    rows = [[q + o for q in prefix] for o in own]  # plain Python: a few dozen lanes, where numpy's per-call cost dominates
    totals = [sum(row) for row in rows]
    if lanes and max(totals) > cap:
        raise ValueError(f"flashinfer plan: {max(totals)} KV slots in one step, the buffer holds {cap}")
    n = packed_len(lanes, steps)
    if out is None:
        out = torch.empty(n, dtype=torch.int32)
    elif out.dtype != torch.int32 or out.device.type != "cpu" or out.numel() < n:
        raise ValueError(f"flashinfer plan: a host int32 buffer of {n} entries, got {out.dtype} [{out.numel()}] on {out.device}")
    indptrs = list(accumulate(qo_lens, initial=0))
    qo_rows = indptrs[-1]
    for row in rows:
        indptrs += accumulate(row, initial=0)
    out[:n].numpy()[:] = indptrs
    kv_lens = np.array(rows, dtype=np.int32).reshape(steps, lanes)
    return KvIndexPlan(out[:n], lanes, steps, kv_lens, totals, qo_rows)
