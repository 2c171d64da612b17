"""Column-, row- and vocab-parallel weight shards (gpt-fast tp.py style: slice full weights).

Every rank builds the same full weights from the seed and keeps its slice, so any
layout is a re-partition of exactly the same model: TP1 is a valid oracle.
"""
from __future__ import annotations

import torch


def shard(w: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if w.shape[dim] % size:
        raise ValueError(f"cannot shard dim {dim} of size {w.shape[dim]} over {size} ranks")
    return w.chunk(size, dim=dim)[rank].contiguous()


def column_parallel(w: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Weight [out, in]: each rank keeps a slice of the output features."""
    return shard(w, 0, rank, size)


def row_parallel(w: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Weight [out, in]: each rank keeps a slice of the input features; outputs are partial sums."""
    return shard(w, 1, rank, size)


def merged_column_parallel(parts: tuple[torch.Tensor, ...], rank: int, size: int) -> torch.Tensor:
    """Several projections' weights stacked as one (the engines' MergedColumnParallelLinear: gate_up_proj), each
    sharded on its own: a rank keeps its slice of every part, in order, so one GEMM gives every part's slice. Sharding
    the stack as one weight would give rank 0 gate rows only and the last rank up rows only."""
    return torch.cat([column_parallel(p, rank, size) for p in parts])


vocab_parallel = column_parallel
