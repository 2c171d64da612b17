"""One simulated rank's communicator: checks its arguments, then meets its peers in the
world's rendezvous (harness.ranks.simulated.SimulatedWorld) with the op's combine step.
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch

from harness.ranks.sim_combine import (
    Combine,
    combine_all_gather,
    combine_all_gather_v,
    combine_all_reduce,
    combine_barrier,
    combine_broadcast,
    combine_reduce_scatter,
)
from runners.parallel.comm import DispatchedCollectives, Group
from runners.parallel.layout import ParallelLayout


class CollectiveWorld(Protocol):
    """What a SimComm needs of its world: the layout and the rendezvous."""

    layout: ParallelLayout
    world_size: int

    def group_instance(self, group: Group, rank: int) -> tuple[int, ...]: ...

    def _collective(self, rank: int, op: str, group: Group, t: Optional[torch.Tensor], params: tuple, combine: Combine): ...


def _group(group: Group | str) -> Group:
    """A Group from a Group or its value (Enum's lookup by value is Python code, run on every collective otherwise)."""
    return group if type(group) is Group else Group(group)


class SimComm(DispatchedCollectives):
    """One rank's view of a SimulatedWorld; implements runners.parallel.comm.Communicator."""

    def __init__(self, world: CollectiveWorld, rank: int) -> None:
        self._world = world
        self.rank = rank
        self.world_size = world.world_size

    def group_ranks(self, group: Group) -> list[int]:
        return list(self._world.group_instance(_group(group), self.rank))

    def _run(self, op: str, t: Optional[torch.Tensor], group: Group, params: tuple, combine: Combine):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: expected a torch.Tensor, got {type(t).__name__}")
        return self._world._collective(
            self.rank, op, _group(group), t.detach() if t is not None else None, params, combine
        )

    def _need_dim0(self, op: str, t: torch.Tensor) -> None:
        if t.dim() == 0:
            raise ValueError(f"rank {self.rank}: {op} needs a tensor with a dim 0 (got a 0-d tensor)")

    def _all_reduce(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        return self._run("all_reduce", t, group, (), combine_all_reduce)

    def _all_gather(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        self._need_dim0("all_gather", t)
        return self._run("all_gather", t, group, (), combine_all_gather)

    def _reduce_scatter(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        self._need_dim0("reduce_scatter", t)
        size = len(self.group_ranks(group))
        if t.shape[0] % size:
            raise ValueError(
                f"rank {self.rank}: reduce_scatter over {Group(group).value} needs dim 0 ({t.shape[0]}) divisible by the group size ({size})"
            )
        return self._run("reduce_scatter", t, group, (), combine_reduce_scatter)

    def _all_gather_v(self, t: torch.Tensor, lengths: Sequence[int], group: Group) -> torch.Tensor:
        self._need_dim0("all_gather_v", t)
        ranks = self.group_ranks(group)
        lengths = tuple(int(n) for n in lengths)
        if len(lengths) != len(ranks):
            raise ValueError(
                f"rank {self.rank}: all_gather_v over {Group(group).value} needs one length per member ({len(ranks)}), got {list(lengths)}"
            )
        if any(n < 0 for n in lengths):
            raise ValueError(f"rank {self.rank}: all_gather_v lengths must be >= 0, got {list(lengths)}")
        mine = lengths[ranks.index(self.rank)]
        if t.shape[0] < mine:
            raise ValueError(
                f"rank {self.rank}: all_gather_v contributes t[:{mine}] but t has only {t.shape[0]} rows (shape {tuple(t.shape)})"
            )
        return self._run("all_gather_v", t, group, (lengths,), combine_all_gather_v)

    def _broadcast(self, t: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        size = len(self.group_ranks(group))
        if not 0 <= src < size:
            raise ValueError(f"rank {self.rank}: broadcast src is a group rank in 0..{size - 1}, got {src}")
        return self._run("broadcast", t, group, (int(src),), combine_broadcast)

    def barrier(self, group: Group) -> None:
        self._run("barrier", None, group, (), combine_barrier)
