"""The collectives around a layer that depend on the layout branch.

- MLP-TP gather: DP-attention ranks gather every DP group's tokens (padded to the
  longest, MAX_LEN) before a world-sharded MLP and scatter their own chunk back; or, in a
  pass whose DP groups' counts are uneven because one extends (SGLang's DpPaddingMode
  SUM_LEN when is_extend_in_batch), concatenate them unpadded: each group's rows at the sum
  of the groups' before it, summed over the world.
- attn-TP gather: attention output is reduce-scattered over the attn-TP group so each
  rank runs the (replicated) MLP on a slice of tokens, then the slices are all-gathered.
- neither: plain TP all-reduce inside the attn-TP group.
The host sizes used here (global_dp_buffer_len, global_num_tokens_cpu) are the values a
CUDA graph bakes at capture.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runners.parallel.comm import Communicator, Group
from runners.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class RankContext:
    """Everything a rank's SPMD code needs to know about where it sits."""

    layout: ParallelLayout
    tp_rank: int
    comm: Communicator

    @property
    def attn_tp_rank(self) -> int:
        return self.layout.attn_tp_rank(self.tp_rank)

    @property
    def attn_dp_rank(self) -> int:
        return self.layout.attn_dp_rank(self.tp_rank)

    @property
    def attn_tp_size(self) -> int:
        return self.layout.attn_tp_size


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] > rows:
        raise ValueError(f"cannot pad {x.shape[0]} rows into a buffer of {rows}")
    return F.pad(x, (0, 0, 0, rows - x.shape[0]))


def dp_max_len(global_dp_buffer_len: int, layout: ParallelLayout) -> int:
    return global_dp_buffer_len // layout.attn_dp_size


def dp_gather(ctx: RankContext, local: torch.Tensor, global_dp_buffer_len: int) -> torch.Tensor:
    """[N_local, H] -> [dp * max_len, H], every DP group's tokens at offset r * max_len."""
    max_len = dp_max_len(global_dp_buffer_len, ctx.layout)
    return ctx.comm.all_gather(pad_rows(local, max_len), Group.ATTN_DP)


def dp_scatter(ctx: RankContext, gathered_partial: torch.Tensor, num_local: int, sharded: bool) -> torch.Tensor:
    """Sum MLP partials over the world (if sharded) and keep this DP group's rows."""
    if sharded:
        if ctx.attn_tp_size > 1:
            gathered_partial = ctx.comm.all_reduce(gathered_partial, Group.ATTN_TP)
        mine = ctx.comm.reduce_scatter(gathered_partial, Group.ATTN_DP)
    else:
        max_len = gathered_partial.shape[0] // ctx.layout.attn_dp_size
        mine = gathered_partial[ctx.attn_dp_rank * max_len : (ctx.attn_dp_rank + 1) * max_len]
    return mine[:num_local]


def dp_offset(global_num_tokens: list[int] | tuple[int, ...], dp_rank: int) -> int:
    return sum(global_num_tokens[:dp_rank])


def dp_gather_sum_len(ctx: RankContext, local: torch.Tensor, global_num_tokens: list[int], global_dp_buffer_len: int) -> torch.Tensor:
    """[N_local, H] -> [Σ N_r, H]: every DP group's rows at its offset, no padding (SUM_LEN). The rows are the same on
    each attn-TP rank of a group, so its first writes them and an all-reduce over the world sums the buffer."""
    buf = local.new_zeros(global_dp_buffer_len, *local.shape[1:])
    if ctx.attn_tp_rank == 0:
        start = dp_offset(global_num_tokens, ctx.attn_dp_rank)
        buf[start : start + local.shape[0]] = local
    return ctx.comm.all_reduce(buf, Group.WORLD)


def dp_scatter_sum_len(ctx: RankContext, gathered_partial: torch.Tensor, global_num_tokens: list[int], num_local: int,
                       sharded: bool) -> torch.Tensor:
    """Sum the MLP partials over the world (if sharded) and keep this DP group's rows."""
    if sharded:
        gathered_partial = ctx.comm.all_reduce(gathered_partial, Group.WORLD)
    start = dp_offset(global_num_tokens, ctx.attn_dp_rank)
    return gathered_partial[start : start + num_local]


def attn_tp_padded_len(num_tokens: int, attn_tp_size: int) -> int:
    return -(-num_tokens // attn_tp_size) * attn_tp_size


def attn_tp_scatter(ctx: RankContext, partial: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce-scatter attention partials over attn-TP; slice the residual the same way."""
    rows = attn_tp_padded_len(partial.shape[0], ctx.attn_tp_size)
    chunk = rows // ctx.attn_tp_size
    reduced = ctx.comm.reduce_scatter(pad_rows(partial, rows), Group.ATTN_TP)
    res = pad_rows(residual, rows)[ctx.attn_tp_rank * chunk : (ctx.attn_tp_rank + 1) * chunk]
    return reduced, res


def attn_tp_gather(ctx: RankContext, local: torch.Tensor, num_tokens: int) -> torch.Tensor:
    return ctx.comm.all_gather(local, Group.ATTN_TP)[:num_tokens]


def mlp_sync_batch_sizes(ctx: RankContext, local_bs: int, device: torch.device) -> list[int]:
    """The scheduler's MLP sync: every DP group learns every group's batch size.

    Idle DP groups (local_bs == 0) take part too: skipping it is the classic hang.
    """
    if not ctx.layout.require_mlp_sync or ctx.layout.attn_dp_size == 1:
        return [local_bs]
    t = torch.tensor([local_bs], dtype=torch.int64, device=device)
    return [int(x) for x in ctx.comm.all_gather(t, Group.ATTN_DP).tolist()]
