"""What a flashinfer plan reads and builds, apart from flashinfer itself (so the CPU can test it).

A plan needs every lane's KV length on the host. The batch's host copies (`seq_lens_cpu`, a verify
batch's `custom_mask_cpu`: the scheduler knows both on the host, and the graph runners keep host
mirrors of their buffers) give them without a device sync; a batch without them is read back.
"""
from __future__ import annotations

from typing import Optional

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


def paged_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_lens: list[int],
                     tail: Optional[torch.Tensor] = None, tail_len: int = 0) -> torch.Tensor:
    """The page-size-1 KV slots of every lane, concatenated: req_to_token[row_b, :kv_lens[b]], then
    (the draft decode) the first tail_len slots of the lane's row of `tail` [lanes, >= tail_len].

    Built on the device with the output size given from the host lengths, so no op has to read
    a size back (a boolean-mask gather would: a device sync); the host does no per-slot work.
    """
    dev, width = req_to_token.device, req_to_token.shape[1]
    total = sum(kv_lens) + tail_len * len(kv_lens)
    prefix = torch.tensor(kv_lens, dtype=torch.int64).to(dev, non_blocking=True)
    lens = prefix + tail_len
    lane = torch.repeat_interleave(torch.arange(len(kv_lens), device=dev), lens, output_size=total)
    offset = torch.arange(total, device=dev) - (torch.cumsum(lens, 0) - lens)[lane]
    rows = req_pool_indices.to(torch.int64)[lane]
    slots = req_to_token.reshape(-1)[rows * width + offset.clamp(max=width - 1)]
    if tail is not None and tail_len:
        own = prefix[lane]
        tail_slots = tail.reshape(-1)[lane * tail.shape[1] + (offset - own).clamp(min=0)]
        slots = torch.where(offset < own, slots, tail_slots)
    return slots.to(torch.int32)

