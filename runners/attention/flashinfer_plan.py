"""What a flashinfer plan reads and builds, apart from flashinfer itself (so the CPU can test it).

A plan needs every lane's KV length on the host. The batch's host copies (`seq_lens_cpu`, a verify
batch's `custom_mask_cpu`: the scheduler knows both on the host, and the graph runners keep host
mirrors of their buffers) give them without a device sync; a batch without them is read back.
"""
from __future__ import annotations

from dataclasses import dataclass
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


def segment_ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The ranges [start, start + len) of every segment, concatenated (int64; zero-length segments add nothing)."""
    ends = np.cumsum(lens)
    return np.repeat(starts - ends + lens, lens) + np.arange(ends[-1] if len(ends) else 0)


@dataclass(frozen=True)
class KvIndexPlan:
    """The host half of a plan of one wrapper group (a wrapper, or the draft decode's one per step): every step's
    indptrs and the gather that writes the planned steps' kv_indices, packed as the group's device buffer holds them,
    so that one host-to-device copy writes them all.

    packed (int32): qo_indptr [lanes + 1], then the kv_indptr [lanes + 1] of steps 0 .. steps - 1, then src [n] (an
    entry of the gather's table: lane's request row * width + column, or a draft slot after the rows), then dst [n]
    (where it lands in the group's kv_indices [steps, cap], flattened).
    """

    packed: torch.Tensor
    lanes: int
    steps: int
    n: int
    kv_lens: np.ndarray  # int32 [steps, lanes]: every lane's KV length at each step
    totals: list[int]  # every step's KV slots (kv_indptr[-1])
    qo_rows: int  # query rows (qo_indptr[-1])

    @property
    def indptr_len(self) -> int:
        return (1 + self.steps) * (self.lanes + 1)

    def qo_indptr(self) -> torch.Tensor:
        return self.packed[: self.lanes + 1]

    def kv_indptr(self, step: int) -> torch.Tensor:
        start = (1 + step) * (self.lanes + 1)
        return self.packed[start: start + self.lanes + 1]

    def kv_lens_host(self, step: int) -> torch.Tensor:
        return torch.from_numpy(self.kv_lens[step])


def kv_index_plan(qo_lens: list[int], prefix: list[int], width: int, cap: int, per_req: int = 1, planned: tuple[int, ...] = (0,),
                  steps: int = 1, draft_slots: int = 0, pin: bool = False) -> KvIndexPlan:
    """Lane n reads the first prefix[n] slots of its request's row, row n // per_req of a gather table whose rows are
    `width` wide (the requests' req_to_token rows). In a draft decode (draft_slots > 0) each lane's draft slots follow
    the rows in the table, draft_slots per lane, and at step s the lane reads its first s + 1 of them after its prefix.
    Only the `planned` steps' kv_indices are gathered (into row s of the group's [steps, cap] buffer); every step's
    indptr is written, since its lengths are known here. Host array work only, no Python loop over slots.
    """
    lanes, n_plan = len(prefix), len(planned)
    if len(qo_lens) != lanes or lanes % per_req:
        raise ValueError(f"flashinfer plan: {len(qo_lens)} query lengths and {lanes} lanes ({per_req} per request)")
    if not all(0 <= s < steps for s in planned) or (draft_slots and steps > draft_slots):
        raise ValueError(f"flashinfer plan: steps {planned} planned of {steps}, {draft_slots} draft slots per lane")
    if lanes and not 0 <= min(prefix) <= max(prefix) <= width:
        raise ValueError(f"flashinfer plan: prefix lengths {prefix} outside a request row of {width} slots")
    if lanes // per_req * width + lanes * draft_slots >= 2 ** 31:
        raise ValueError("flashinfer plan: the gather table is too large for int32 indices")
    p = np.array(prefix, dtype=np.int32)
    own = np.arange(1, steps + 1, dtype=np.int32) if draft_slots else np.zeros(steps, dtype=np.int32)
    kv_lens = p + own[:, None]  # [steps, lanes]
    totals = kv_lens.sum(1)
    if lanes and totals.max() > cap:
        raise ValueError(f"flashinfer plan: {int(totals.max())} KV slots in one step, the buffer holds {cap}")
    seg = np.empty((2, n_plan, lanes, 2), dtype=np.int64)  # (start, len) of every lane's prefix, then of its own slots
    lane = np.arange(lanes)
    seg[0, :, :, 0] = lane // per_req * width
    seg[0, :, :, 1] = lanes // per_req * width + lane * draft_slots
    seg[1, :, :, 0] = p
    seg[1, :, :, 1] = own[list(planned), None]
    src = segment_ranges(seg[0].reshape(-1), seg[1].reshape(-1))
    dst = segment_ranges(np.array(planned) * cap, totals[list(planned)])
    n = len(src)
    packed = torch.empty((1 + steps) * (lanes + 1) + 2 * n, dtype=torch.int32, pin_memory=pin)
    indptrs = np.zeros((1 + steps, lanes + 1), dtype=np.int64)
    np.cumsum(qo_lens, out=indptrs[0, 1:])
    np.cumsum(kv_lens, 1, out=indptrs[1:, 1:])
    np.concatenate([indptrs.reshape(-1), src, dst], out=packed.numpy(), casting="same_kind")
    return KvIndexPlan(packed, lanes, steps, n, kv_lens, totals.tolist(), int(indptrs[0, -1]))


def gather_kv_indices(plan: KvIndexPlan, index: torch.Tensor, table: torch.Tensor, kv_indices: torch.Tensor) -> None:
    """kv_indices.view(-1)[dst] = table[src], with the plan's src and dst as the device buffer `index` holds them (at
    plan.indptr_len, where the copy of plan.packed put them): the planned steps' KV slots, one gather, one scatter."""
    if plan.n:
        src = index[plan.indptr_len: plan.indptr_len + plan.n]
        dst = index[plan.indptr_len + plan.n: plan.indptr_len + 2 * plan.n]
        kv_indices.view(-1).index_put_((dst,), table[src].to(kv_indices.dtype))
