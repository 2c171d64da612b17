"""The logits processor, with the DP gather driven by global_num_tokens_for_logprob.

When the batch carries gathered metadata (a gathered buffer is required), the hidden rows
given to lm_head are exactly the first for_logprob[r] rows of each DP rank, copied into a
buffer of G rows (G = Σ for_logprob_cpu if the host list is given, else global_dp_buffer_len),
at offset start_r = Σ_{q<r} for_logprob[q] (why: docs/properties.md, I2 and I4). Offsets
and counts are read from the gpu tensor (what the graph holds at replay), G from the
host list (what the graph baked at capture). The cross-DP all-reduce and the world-wide
vocab shard are only used when the layout's logits DP gather is active; in the
attn-TP-gather branch the same copy runs over a single slot (our simulator makes the
count matter in every gathered branch, so a wrong count is a visible symptom, not a
latent one).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runners.batch import ForwardBatch
from runners.model import SharedHead
from runners.parallel.comm import Group
from runners.parallel.dp_attention import RankContext


@dataclass
class LogitsOutput:
    next_token_logits: torch.Tensor  # [N_local, V] (rows not given to lm_head are zero)
    rows_fed: torch.Tensor  # int64 scalar tensor: this rank's rows that reached lm_head


def vocab_parallel_logits(ctx: RankContext, head: SharedHead, hidden: torch.Tensor) -> torch.Tensor:
    local = hidden @ head.lm_head.T  # [rows, V / lm_size]
    if head.lm_size == 1:
        return local
    return ctx.comm.all_gather(local.T.contiguous(), head.lm_group).T  # gather the vocab dim


def logits_processor(ctx: RankContext, head: SharedHead, hidden: torch.Tensor, fb: ForwardBatch) -> LogitsOutput:
    n = hidden.shape[0]
    counts = fb.global_num_tokens_for_logprob_gpu
    if counts is None:
        rows = torch.full((), n, dtype=torch.int64, device=hidden.device)  # a fill kernel: no host-to-device copy under capture
        return LogitsOutput(vocab_parallel_logits(ctx, head, hidden), rows)

    dp_gather = ctx.layout.logits_dp_gather
    counts = counts.to(torch.int64)
    host = fb.global_num_tokens_for_logprob_cpu
    r = ctx.attn_dp_rank if counts.shape[0] > 1 else 0  # own entry: (dp,) in the MLP branch, (1,) in the attn branch
    if dp_gather:  # rows of every DP rank, concatenated (sum-of-lengths)
        g = int(sum(host)) if host is not None else int(fb.global_dp_buffer_len)
        start = counts.cumsum(0)[r] - counts[r]
    else:  # lm_head stays inside the attn-TP group: only this DP rank's rows
        g = int(host[r]) if host is not None else int(fb.global_dp_buffer_len) // counts.shape[0]
        start = torch.zeros((), dtype=torch.int64, device=hidden.device)
    local = torch.arange(n, device=hidden.device)
    dst = start + local
    valid = (local < counts[r]) & (dst < g)
    dst = torch.where(valid, dst, torch.full_like(dst, g))  # invalid rows land in a discarded extra row

    buf = torch.zeros(g + 1, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    writes = valid if not dp_gather or ctx.attn_tp_rank == 0 else torch.zeros_like(valid)
    src = torch.where(writes[:, None], hidden, torch.zeros_like(hidden))
    buf.index_add_(0, dst, src)
    gathered = buf[:g]
    if dp_gather:
        gathered = ctx.comm.all_reduce(gathered, Group.WORLD)

    logits_g = vocab_parallel_logits(ctx, head, gathered)  # [G, V]
    padded = torch.cat([logits_g, logits_g.new_zeros(1, logits_g.shape[1])], dim=0)  # the discarded row, also when G = 0
    out = torch.where(valid[:, None], padded[dst], torch.zeros_like(padded[:1]))
    return LogitsOutput(out, valid.sum())
