"""The communicator interface every rank's SPMD code talks to.

The model never calls torch.distributed directly: it calls a `Communicator`, so the
same code runs under simulated ranks (threads in one process, harness.ranks.simulated)
and real ranks (torch.distributed gloo / nccl, harness.ranks.distributed). Collectives
are functional (they return a new tensor) so that both back ends are trivially correct
and the simulated one can record and check every call.
"""
from __future__ import annotations

from enum import Enum
from typing import Protocol, Sequence, runtime_checkable

import torch


class Group(str, Enum):
    """Named process groups of a layout (see ParallelLayout.group_ranks).

    WORLD: all tp_size ranks. ATTN_TP: the ranks of one DP-attention group (they shard
    attention heads). ATTN_DP: the ranks with the same attn_tp_rank across DP groups
    (one per DP group; the DP gather/scatter of the MLP-TP branch runs over it).
    """

    WORLD = "world"
    ATTN_TP = "attn_tp"
    ATTN_DP = "attn_dp"


@runtime_checkable
class Communicator(Protocol):
    rank: int
    world_size: int

    def group_ranks(self, group: Group) -> list[int]:
        """Global ranks of the group this rank belongs to, in group-rank order."""

    def all_reduce(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        """Sum over the group."""

    def all_gather(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        """Concatenate every member's tensor along dim 0 (same shape on every member)."""

    def reduce_scatter(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        """Sum over the group, then return this member's chunk of dim 0 (dim 0 divisible by group size)."""

    def all_gather_v(self, t: torch.Tensor, lengths: Sequence[int], group: Group) -> torch.Tensor:
        """All-gather into a buffer with per-rank lengths: member i contributes t[:lengths[i]]; result is the concatenation."""

    def broadcast(self, t: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        """Return group member `src`'s tensor (src is a group rank) on every member."""

    def barrier(self, group: Group) -> None:
        ...


def group_size(comm: Communicator, group: Group) -> int:
    return len(comm.group_ranks(group))


def group_rank(comm: Communicator, group: Group) -> int:
    return comm.group_ranks(group).index(comm.rank)
