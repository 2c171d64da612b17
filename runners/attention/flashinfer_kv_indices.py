"""The flashinfer backend's kv_indices, written on the device from the plan's kv_indptr.

flashinfer reads a flat slot list per wrapper: lane n's keys are kv_indices[kv_indptr[n] :
kv_indptr[n + 1]]. The host knows only the lengths (the plan's indptrs); the slots live in the
requests' req_to_token rows and, in a draft decode, in the lanes' draft slots. The engines build
that list with one Triton kernel per wrapper over the device indptr (SGLang's
create_flashinfer_kv_indices_triton, and its draft-decode twin over every step); here that kernel
is launched by the pass's first layer, so under a CUDA graph it is captured and every replay
rebuilds the list from the replay fill's req_pool_indices and the replay plan's indptr, with no
host gather before the replay.

Lane n (request n // per_req) reads the first kv_len - own_len slots of its request's row, then
its own draft slots 0 .. own_len - 1 (row n of `own`, a [lanes, steps] slot buffer; own_len is 0
outside a draft decode), at most a whole row and its own slots. Nothing past kv_indptr[lanes] is
written.
"""
from __future__ import annotations

from typing import Optional

import torch

from runners.attention.triton_launch import run_kernel, tl, triton

BLOCK = 128


@triton.jit
def _kv_indices_kernel(req_to_token, req_pool_indices, kv_indptr, own, out, width, per_req, own_stride, own_len,
                       MAX_LEN: tl.constexpr, BLOCK: tl.constexpr):
    lane = tl.program_id(0)
    start = tl.load(kv_indptr + lane)
    length = tl.load(kv_indptr + lane + 1) - start
    row = tl.load(req_pool_indices + lane // per_req).to(tl.int64)
    prefix = length - own_len
    for off in range(0, MAX_LEN, BLOCK):  # a constexpr bound (the interpreter needs one); slots past length are masked
        j = off + tl.arange(0, BLOCK)
        live = j < length
        from_row = tl.load(req_to_token + row * width + j, mask=live & (j < prefix) & (row >= 0), other=0)  # a pad request (-1): the null slot
        from_own = tl.load(own + lane * own_stride + (j - prefix), mask=live & (j >= prefix), other=0)
        tl.store(out + start + j, tl.where(j < prefix, from_row, from_own), mask=live)


def write_kv_indices(kv_indptr: torch.Tensor, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, out: torch.Tensor,
                     per_req: int = 1, own: Optional[torch.Tensor] = None, own_len: int = 0) -> None:
    """out[kv_indptr[n] + j] = lane n's j-th key slot, for every lane n < len(kv_indptr) - 1 (one launch, graph-safe:
    the grid is the lane count, every length is read on the device)."""
    lanes = kv_indptr.shape[0] - 1
    if own is None:
        if own_len:
            raise ValueError(f"kv_indices: {own_len} own slots per lane and no slot buffer")
        own = out  # never read: every lane's keys come from its request's row
    elif own.dim() != 2 or own.shape[0] != lanes or own.shape[1] < own_len:
        raise ValueError(f"kv_indices: draft slots {tuple(own.shape)} for {lanes} lanes reading {own_len} each")
    if req_to_token.stride(1) != 1 or own.stride(-1) != 1:
        raise ValueError("kv_indices: req_to_token rows and the draft slot rows must be contiguous")
    if lanes <= 0:
        return
    run_kernel(_kv_indices_kernel, (lanes,), req_to_token, req_pool_indices, kv_indptr, own, out, req_to_token.stride(0),
               per_req, own.stride(0), own_len, MAX_LEN=req_to_token.shape[1] + (own.shape[1] if own_len else 0), BLOCK=BLOCK)
