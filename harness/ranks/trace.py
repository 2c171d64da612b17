"""The record of one collective call, shared by simulated and real ranks.

Both back ends record the same thing so that "simulated vs real" can be a property:
the same SPMD code must issue the same collectives, in the same order, with the same
shapes, on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CollectiveCall:
    seq: int  # index in this rank's trace
    op: str  # all_reduce | all_gather | reduce_scatter | all_gather_v | broadcast | barrier
    group: str  # Group value: world | attn_tp | attn_dp
    group_ranks: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str  # str(torch.dtype), e.g. "torch.float32"

    @classmethod
    def of(cls, seq: int, op: str, group: str, group_ranks: tuple[int, ...], tensor) -> "CollectiveCall":
        """The record of a call on `tensor` (None for a barrier: shape (), dtype "")."""
        if tensor is None:
            return cls(seq, op, group, group_ranks, (), "")
        return cls(seq, op, group, group_ranks, tuple(tensor.shape), str(tensor.dtype))

    def describe(self) -> str:
        return f"{self.op}(group={self.group}, shape={self.shape}, dtype={self.dtype.removeprefix('torch.')})"


class CollectiveError(RuntimeError):
    """A collective that cannot complete: a mismatch between ranks, a peer that failed, or a deadline."""


class CollectiveMismatch(CollectiveError):
    pass


class CollectiveTimeout(CollectiveError):
    pass
