"""Mutants of how a rank keeps its slice of the full weights (runners.parallel.linear).

Every layout re-partitions the same seeded weights, so TP1 is the oracle: a rank that keeps the wrong
slice computes another model, which P4 (every layout against TP1 eager) sees, while eager and graph
of the same layout agree with each other (P3 cannot).
"""
from __future__ import annotations

import torch

from harness.mutants.base import Mutant
from runners import model
from runners.parallel.linear import column_parallel


def _stack_sharded_as_one(parts: tuple[torch.Tensor, ...], rank: int, size: int) -> torch.Tensor:
    return column_parallel(torch.cat(parts), rank, size)  # over 2 ranks: rank 0 keeps gate rows only, rank 1 up rows only


MUTANTS: list[Mutant] = [
    Mutant(
        "gate-up-sharded-as-one",
        "the merged gate_up_proj weight is sharded as one matrix instead of gate and up each on its own: with the MLP "
        "sharded, a rank multiplies gate rows by gate rows (or up by up), another model than TP1's",
        "merged weight sharded as one",
        ((model, "merged_column_parallel", _stack_sharded_as_one),),
        ("cases",),  # P4 (TP > 1 with a sharded MLP against TP1)
    ),
]
