"""The mutated Triton helpers of harness.mutants.triton_kernel, in a module of their own: a jit function needs
triton.language among its globals, and triton is optional, so the catalog imports this only to plant one."""
from __future__ import annotations

from runners.attention.triton_launch import tl, triton


@triton.jit
def kv_block_unmasked_values(K, V, req_to_token, req, kv_len, kvh, n0, offs_d, d_mask,
                             stride_kn, stride_kh, stride_vn, stride_vh, stride_rt, BLOCK_N: tl.constexpr):
    """runners.attention.triton_backend._kv_block with the values of every key loaded, past kv_len too."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < kv_len
    slot = tl.load(req_to_token + req * stride_rt + offs_n, mask=n_mask, other=0).to(tl.int64)
    k = tl.load(K + slot[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    v = tl.load(V + slot[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :], mask=d_mask[None, :], other=0.0)
    return offs_n, n_mask, k, v
