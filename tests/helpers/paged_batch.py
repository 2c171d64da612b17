"""A paged KV cache with random prefix KV and one attention batch over it: what the backend tests compare backends on."""
from __future__ import annotations

import torch

from runners.batch import EagleDraftInput, ForwardBatch, ForwardMode
from runners.memory import PADDING_SLOT, ReqToTokenPool, TokenToKVPool

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def paged_batch(prefixes, T, hq, hkv, d, *, C=64, dtype=torch.float32, pad_lanes=0, mode=ForwardMode.DRAFT_EXTEND_V2, seed=0,
                stale_pad_req=False):
    """A pool with random prefix KV and one batch of len(prefixes) requests (+ padded lanes, as a graph replay fills them)."""
    g = torch.Generator().manual_seed(seed)
    dev = DEVICE
    rp = ReqToTokenPool(len(prefixes) + 2, C, dev)
    kp = TokenToKVPool(1, 1 + sum(p + T for p in prefixes) + 8, hkv, d, dtype, dev)
    kp.k[0].copy_(torch.randn(kp.k[0].shape, generator=g).to(dtype))
    kp.v[0].copy_(torch.randn(kp.v[0].shape, generator=g).to(dtype))
    seq, locs, pos, idxs = [], [], [], []
    for p in prefixes:
        i = rp.alloc()
        s = kp.alloc(p + T)
        rp.req_to_token[i, : len(s)] = torch.tensor(s, device=dev)
        idxs.append(i)
        seq.append(p + T)
        locs += s[p:]
        pos += list(range(p, p + T))
    for _ in range(pad_lanes):  # the replay fill: seq_len 1, position 0, padding slot; req index 0 or a stale one
        idxs.append(idxs[0] if stale_pad_req else 0)
        seq.append(1)
        locs += [PADDING_SLOT] * T
        pos += [0] * T
    bs = len(seq)
    n = bs * T
    i64 = dict(dtype=torch.int64, device=dev)
    fb = ForwardBatch(
        forward_mode=mode, batch_size=bs, input_ids=torch.zeros(n, **i64), positions=torch.tensor(pos, **i64),
        seq_lens=torch.tensor(seq, **i64), req_pool_indices=torch.tensor(idxs, **i64), out_cache_loc=torch.tensor(locs, **i64),
        extend_seq_lens=torch.full((bs,), T, **i64), extend_start_loc=torch.arange(bs, **i64) * T,
        spec_info=EagleDraftInput(torch.zeros(n, 8, device=dev), torch.zeros(bs, **i64), torch.ones(bs, **i64)),
        extend_seq_lens_cpu=[T] * bs, extend_num_tokens=n, num_token_non_padded=len(prefixes) * T,
    )
    q = torch.randn(n, hq, d, generator=g).to(dtype).to(dev)
    k = torch.randn(n, hkv, d, generator=g).to(dtype).to(dev)
    v = torch.randn(n, hkv, d, generator=g).to(dtype).to(dev)
    return rp, kp, fb, q, k, v
