"""Triton attention over the paged (page size 1) KV cache: a draft-extend kernel and a decode kernel.

Same semantics as the torch reference (runners/attention/torch_ref.py): the pass's K/V are
written at out_cache_loc first, then token t of request lane b attends the keys at
key positions j of row req_to_token[req_pool_indices[b]] with j < seq_lens[b] and
j <= positions[t] (a tree verify: j below the root's position, or a node the tree mask
gives). Everything the kernels read lives in device tensors; the only host
values (grid, block sizes) come from the batch's host metadata, so a launch is
graph-capturable and a replay reads the static buffers' live contents.

- `_extend_kernel`: one program per (request lane, query head, block of BLOCK_M query
  tokens); online softmax over key blocks of BLOCK_N with `tl.dot`
  (`input_precision="ieee"` so fp32 is exact fp32 on the GPU, never TF32).
- `_decode_kernel`: one program per (token, query head); the query is a vector, scores
  are an elementwise product and a sum (no tl.dot), so it also serves one-token-per-request
  DECODE batches of any head_dim. With BLOCK_S > 0 it is the single-layer draft decode's
  kernel (`init_draft_decode_metadata`): lane (b, t) at draft step s reads request b's prefix
  (keys below seq_len) and then its own draft slots of steps 0..s, read in-kernel from the
  [lanes, steps] slot buffer the step body fills inside the graph (the engine's multi-step
  draft backends build one kv_indices per step for the same keys); s is a host value, the
  same at capture and replay.

Without CUDA the kernels run in Triton's interpreter (runners/attention/triton_launch.py says
when that can be and `interpreter_error()` why it cannot). The interpreter is an oracle for
indexing and masks in fp32, not for GPU numerics (bf16 is checked on the GPU: docs/gpu.md, Backends).
A row with no visible key (impossible for a well-formed batch: key 0 is always visible
to a token at position >= 0 with seq_len >= 1) gives 0 where the reference gives NaN.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from runners.attention.torch_ref import token_to_request
from runners.attention.triton_launch import interpreter_error, run_kernel, tl, triton
from runners.batch import EagleVerifyInput, ForwardBatch, ForwardMode
from runners.memory import ReqToTokenPool, TokenToKVPool


@triton.jit
def _kv_block(K, V, req_to_token, req, kv_len, kvh, n0, offs_d, d_mask,
              stride_kn, stride_kh, stride_vn, stride_vh, stride_rt, BLOCK_N: tl.constexpr):
    """One block of a request's keys and values through its req_to_token row; keys >= kv_len read as 0 (masked).
    A pad request (req -1, vLLM's convention) reads the null slot 0 for every key: its row would be memory before
    req_to_token (bounds only: what it reads reaches the pad lane's own rows alone)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < kv_len
    slot = tl.load(req_to_token + req * stride_rt + offs_n, mask=n_mask & (req >= 0), other=0).to(tl.int64)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(K + slot[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + slot[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    return offs_n, n_mask, k, v


@triton.jit
def _online_softmax(s, visible, m_i, l_i):
    """The flash-attention update for one block of scores: (p, the rescale of what came before, new max, new sum).
    A row with nothing visible yet keeps max -inf and sum 0 (m_safe avoids inf - inf)."""
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _extend_kernel(
    Q, K, V, Out,
    req_to_token, req_pool_indices, seq_lens, positions, start_loc, ext_lens, tree_mask,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, stride_rt,
    sm_scale,
    MAX_CTX: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TREE_T: tl.constexpr,
):
    """One program per (request lane, KV head, block of BLOCK_M rows); a row is one
    (token, query head) pair of that KV head's GQA group: row r = token r // GROUP,
    head kvh * GROUP + r % GROUP. TREE_T > 0: a tree verify of TREE_T nodes per lane, keys
    from the root's position on masked by tree_mask [bs, T, T] (int8) instead of causally."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    mblk = tl.program_id(2)
    start = tl.load(start_loc + b).to(tl.int64)
    qlen = tl.load(ext_lens + b).to(tl.int64)
    seq = tl.load(seq_lens + b).to(tl.int64)
    req = tl.load(req_pool_indices + b).to(tl.int64)
    kv_len = tl.where(seq < MAX_CTX, seq, MAX_CTX)

    rows = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    tok_i = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    m_mask = tok_i < qlen
    tok = start + tok_i
    pos = tl.load(positions + tok, mask=m_mask, other=0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    qo_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + tok[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :], mask=qo_mask, other=0.0)
    if TREE_T > 0:
        root = tl.load(positions + start).to(tl.int64)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    for n0 in range(0, MAX_CTX, BLOCK_N):  # a constexpr bound (the interpreter needs one); keys >= kv_len are masked
        offs_n, n_mask, k, v = _kv_block(K, V, req_to_token, req, kv_len, kvh, n0, offs_d, d_mask,
                                         stride_kn, stride_kh, stride_vn, stride_vh, stride_rt, BLOCK_N)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale  # [BLOCK_M, BLOCK_N], fp32
        if TREE_T > 0:
            rel = offs_n[None, :] - root  # key column - root position: the lane's own nodes are 0 .. T-1
            own = (rel >= 0) & (rel < TREE_T) & m_mask[:, None]
            bits = tl.load(tree_mask + b * TREE_T * TREE_T + tok_i[:, None] * TREE_T + rel, mask=own, other=0)
            visible = n_mask[None, :] & m_mask[:, None] & ((rel < 0) | (bits != 0))
        else:
            visible = n_mask[None, :] & (offs_n[None, :] <= pos[:, None]) & m_mask[:, None]
        p, alpha, m_i, l_i = _online_softmax(s, visible, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(Out + tok[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty), mask=qo_mask)


@triton.jit
def _decode_kernel(
    Q, K, V, Out,
    req_to_token, req_pool_indices, seq_lens, positions, token_to_req, draft_locs,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, stride_rt, stride_locs,
    num_draft, sm_scale,
    MAX_CTX: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One program per (token, KV head): the GROUP query heads of that KV head; scores
    by an elementwise product and a sum (no tl.dot, so any head_dim and group size).
    BLOCK_S > 0: a single-layer draft decode step, token t is lane t of the draft tree; it reads its
    request's prefix (keys below seq_len, whatever its position) and then the first num_draft slots of
    its own row of draft_locs [lanes, stride_locs] (its draft tokens of the steps so far)."""
    t = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    b = tl.load(token_to_req + t).to(tl.int64)
    seq = tl.load(seq_lens + b).to(tl.int64)
    req = tl.load(req_pool_indices + b).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    kv_len = tl.where(seq < MAX_CTX, seq, MAX_CTX)
    g = tl.arange(0, BLOCK_G)
    g_mask = g < GROUP
    head = kvh * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    qo_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + t * stride_qn + head[:, None] * stride_qh + offs_d[None, :], mask=qo_mask, other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, dtype=tl.float32)
    for n0 in range(0, MAX_CTX, BLOCK_N):
        offs_n, n_mask, k, v = _kv_block(K, V, req_to_token, req, kv_len, kvh, n0, offs_d, d_mask,
                                         stride_kn, stride_kh, stride_vn, stride_vh, stride_rt, BLOCK_N)
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], 2) * sm_scale  # [BLOCK_G, BLOCK_N]
        if BLOCK_S == 0:
            n_mask = n_mask & (offs_n <= pos)
        visible = n_mask[None, :] & g_mask[:, None]
        p, alpha, m_i, l_i = _online_softmax(s, visible, m_i, l_i)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
    if BLOCK_S > 0:
        offs_s = tl.arange(0, BLOCK_S)
        s_mask = offs_s < num_draft
        slot = tl.load(draft_locs + t * stride_locs + offs_s, mask=s_mask, other=0).to(tl.int64)
        kv_mask = s_mask[:, None] & d_mask[None, :]
        k = tl.load(K + slot[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + slot[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], 2) * sm_scale  # [BLOCK_G, BLOCK_S]
        p, alpha, m_i, l_i = _online_softmax(s, s_mask[None, :] & g_mask[:, None], m_i, l_i)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(Out + t * stride_on + head[:, None] * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty), mask=qo_mask)


_KERNELS = {k.fn.__name__: k for k in (_extend_kernel, _decode_kernel)}


def _triton_attention(kernel: str, grid: list[int], out: torch.Tensor, tensors: list[torch.Tensor], ints: list[int],
                      floats: list[float], kinds: str) -> None:
    """One kernel launch as a dispatcher op, so a recording graph sees it (runners.graph.record).
    `kinds` spells the kernel's positional arguments: o = out, t / i / f = the next tensor, int, float."""
    it = {"t": iter(tensors), "i": iter(ints), "f": iter(floats)}
    args = [out if k == "o" else next(it[k]) for k in kinds]
    run_kernel(_KERNELS[kernel], tuple(grid), *args)


LIBRARY = torch.library.Library("specharness", "FRAGMENT")  # a plain library op: see runners/parallel/comm.py
LIBRARY.define("triton_attention(str kernel, int[] grid, Tensor(a!) out, Tensor[] tensors, int[] ints, float[] floats, str kinds) -> ()")
LIBRARY.impl("triton_attention", _triton_attention, "CompositeExplicitAutograd")
torch.library.register_fake("specharness::triton_attention", lambda *args: None, lib=LIBRARY)


def _launch(kernel, device: torch.device, grid: tuple[int, ...], *args, **meta) -> None:
    """Launch through `specharness::triton_attention`; the kernel's `Out` is the tensor it writes."""
    err = interpreter_error(device)
    if err is not None:
        raise RuntimeError(err)
    args = (*args, *(meta[name] for name in kernel.arg_names[len(args):]))
    out_at = kernel.arg_names.index("Out")
    kinds = "".join("o" if i == out_at else "t" if isinstance(a, torch.Tensor) else "f" if isinstance(a, float) else "i"
                    for i, a in enumerate(args))
    pick = {k: [a for a, c in zip(args, kinds, strict=True) if c == k] for k in "tif"}
    torch.ops.specharness.triton_attention(kernel.fn.__name__, list(grid), args[out_at], pick["t"], pick["i"], pick["f"], kinds)


@dataclass
class TritonAttnMetadata:
    token_to_req: torch.Tensor  # [N] request lane of each token (device)
    max_extend_len: int  # host: the longest extend segment (grid and BLOCK_M)
    decode: bool  # one token per request: the decode kernel
    tree_mask: Optional[torch.Tensor] = None  # a tree verify's [bs, T, T] mask as int8 (the kernel reads bytes)
    tree_t: int = 0  # host: T of a tree verify, 0 otherwise


@dataclass
class TritonDraftDecodeMetadata:
    """One step of a single-layer draft decode: the decode kernel with every lane's draft slots."""

    token_to_req: torch.Tensor  # [bs * topk] request lane of each draft-tree lane (device)
    locs: torch.Tensor  # [bs * topk, steps] every lane's draft slots, all steps (device; the kernel reads its row)
    num_draft: int  # host: the draft slots a lane reads at this step (steps 0..step)


class TritonAttnBackend:
    name = "triton"
    BLOCK_N = 64

    def __init__(self, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool):
        self.req_pool = req_pool
        self.kv_pool = kv_pool

    def init_forward_metadata(self, fb: ForwardBatch) -> TritonAttnMetadata:
        n = fb.input_ids.shape[0]
        token_to_req = token_to_request(fb)
        ext = list(fb.extend_seq_lens_cpu) if fb.extend_seq_lens_cpu else []
        max_ext = max(ext) if ext else (n // max(fb.batch_size, 1) if fb.batch_size else 0)
        decode = fb.forward_mode is ForwardMode.DECODE
        if isinstance(fb.spec_info, EagleVerifyInput):
            tree = fb.spec_info
            return TritonAttnMetadata(token_to_req, int(max_ext), decode, tree.custom_mask.to(torch.int8), tree.draft_token_num)
        return TritonAttnMetadata(token_to_req, int(max_ext), decode)

    def init_draft_decode_metadata(self, fb: ForwardBatch, locs: torch.Tensor, step: int) -> TritonDraftDecodeMetadata:
        """Lane (b, t) at draft step `step` (locs [bs, topk, steps]): request b's prefix, then its own slots of steps 0..step."""
        bs, topk, steps = locs.shape
        lane_req = torch.arange(bs * topk, device=locs.device) // topk
        return TritonDraftDecodeMetadata(lane_req, locs.reshape(bs * topk, steps), step + 1)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch,
                meta: TritonAttnMetadata | TritonDraftDecodeMetadata) -> torch.Tensor:
        """q [N, hq, d], k/v [N, hkv, d] (this pass's tokens) -> [N, hq, d]."""
        self.kv_pool.write(layer, fb.out_cache_loc, k, v)
        kc, vc = self.kv_pool.k[layer], self.kv_pool.v[layer]
        n, hq, d = q.shape
        o = torch.empty_like(q)
        if n == 0:
            return o
        if kc.dtype != q.dtype:
            kc, vc = kc.to(q.dtype), vc.to(q.dtype)
        q = q.contiguous()
        group = hq // kc.shape[1]
        rt = self.req_pool.req_to_token
        strides = (q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), o.stride(0), o.stride(1), rt.stride(0))
        hkv = kc.shape[1]
        sizes = dict(MAX_CTX=int(rt.shape[1]), GROUP=group, HEAD_DIM=d, BLOCK_G=triton.next_power_of_2(group), BLOCK_N=self.BLOCK_N,
                     BLOCK_D=triton.next_power_of_2(d))
        decode_args = (q, kc, vc, o, rt, fb.req_pool_indices, fb.seq_lens, fb.positions, meta.token_to_req)
        if isinstance(meta, TritonDraftDecodeMetadata):
            locs = meta.locs
            _launch(_decode_kernel, q.device, (n, hkv), *decode_args, locs, *strides, locs.stride(0), meta.num_draft, float(d ** -0.5),
                    **sizes, BLOCK_S=triton.next_power_of_2(locs.shape[1]))
        elif meta.decode:  # no draft slots: the locs argument is a placeholder the kernel never reads
            _launch(_decode_kernel, q.device, (n, hkv), *decode_args, fb.positions, *strides, 0, 0, float(d ** -0.5), **sizes, BLOCK_S=0)
        else:
            rows = max(meta.max_extend_len, 1) * group
            block_m = max(16, min(64, triton.next_power_of_2(rows)))
            grid = (fb.batch_size, hkv, triton.cdiv(rows, block_m))
            tree = meta.tree_mask if meta.tree_mask is not None else fb.positions  # no tree: a placeholder the kernel never reads
            _launch(_extend_kernel, q.device, grid, q, kc, vc, o, rt, fb.req_pool_indices, fb.seq_lens, fb.positions, fb.extend_start_loc,
                    fb.extend_seq_lens, tree, *strides, float(d ** -0.5), MAX_CTX=int(rt.shape[1]), GROUP=group, HEAD_DIM=d, BLOCK_M=block_m,
                    BLOCK_N=self.BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(d)), TREE_T=meta.tree_t)
        return o
