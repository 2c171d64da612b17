"""The record of one collective call, shared by simulated and real ranks.

Both back ends record the same thing so that "simulated vs real" can be a property:
the same SPMD code must issue the same collectives, in the same order, with the same
shapes, on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


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


def _call_text(call: Optional[CollectiveCall], trace_len: int) -> str:
    if call is None:
        return f"nothing (its trace ends after {trace_len} calls)"
    return f"{call.describe()} over ranks {call.group_ranks}"


def compare_traces(
    traces_a: Sequence[Sequence[CollectiveCall]], traces_b: Sequence[Sequence[CollectiveCall]]
) -> Optional[str]:
    """None when both runs issued the same collectives; else a one-line description of the first difference.

    "First" is the lowest call index across ranks (lowest rank on ties): the earliest point
    where the two runs diverge, which is where to look.
    """
    if len(traces_a) != len(traces_b):
        return f"world sizes differ: a has {len(traces_a)} ranks, b has {len(traces_b)}"
    longest = max((max(len(a), len(b)) for a, b in zip(traces_a, traces_b, strict=True)), default=0)
    for i in range(longest):
        for rank, (ta, tb) in enumerate(zip(traces_a, traces_b, strict=True)):
            ca = ta[i] if i < len(ta) else None
            cb = tb[i] if i < len(tb) else None
            if ca != cb:
                return f"rank {rank} call #{i}: a called {_call_text(ca, len(ta))}, b called {_call_text(cb, len(tb))}"
    return None
