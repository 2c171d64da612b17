"""Mutants of how a rank keeps its slice of the full weights (runners.parallel.linear, runners.model.head_shard).

Every layout re-partitions the same seeded weights, so TP1 is the oracle: a rank that keeps the wrong
slice computes another model, which P4 (every layout against TP1 eager) sees, while eager and graph
of the same layout agree with each other (P3 cannot).
"""
from __future__ import annotations

from typing import Callable

import torch

from harness.mutants.base import Mutant, Wrap
from runners import model
from runners.parallel.linear import column_parallel


def _kv_heads_round_robin(real: Callable[..., model.HeadShard]) -> Callable[..., model.HeadShard]:
    def head_shard(cfg, attn_tp_rank: int, attn_tp_size: int) -> model.HeadShard:
        hs = real(cfg, attn_tp_rank, attn_tp_size)
        if attn_tp_size <= cfg.num_kv_heads:
            return hs
        return model.HeadShard(hs.q_start, hs.q_count, attn_tp_rank % cfg.num_kv_heads, hs.kv_count)  # not the q heads' group

    return head_shard


def _stack_sharded_as_one(parts: tuple[torch.Tensor, ...], rank: int, size: int) -> torch.Tensor:
    return column_parallel(torch.cat(parts), rank, size)  # over 2 ranks: rank 0 keeps gate rows only, rank 1 up rows only


MUTANTS: list[Mutant] = [
    Mutant(
        "gate-up-sharded-as-one",
        "the merged gate_up_proj weight is sharded as one matrix instead of gate and up each on its own: with the MLP "
        "sharded, a rank multiplies gate rows by gate rows (or up by up), another model than TP1's",
        "merged weight sharded as one",
        ((model, "merged_column_parallel", _stack_sharded_as_one),),
        ("cases:tp2_dp2_mlp_dp_lm_head", "cases"),  # P4 (TP > 1 with a sharded MLP against TP1)
    ),
    Mutant(
        "kv-head-replica-round-robin",
        "with more attention-TP ranks than KV heads, the qkv_proj weight gives rank r KV head r % num_kv_heads instead "
        "of the head its q heads' GQA group reads (r // (attn_tp_size / num_kv_heads)): the weight loader's replica "
        "mapping, wrong on every rank but the first of each group",
        "KV head replica on the wrong rank",
        ((model, "head_shard", Wrap(_kv_heads_round_robin)),),
        ("cases:tp4_attn_tp_gather", "cases"),  # P4 (attn-TP 4 with 2 KV heads against TP1)
    ),
]
