"""The communicator interface every rank's SPMD code talks to.

The model never calls torch.distributed directly: it calls a `Communicator`, so the
same code runs under simulated ranks (threads in one process, harness.ranks.simulated)
and real ranks (torch.distributed gloo / nccl, harness.ranks.distributed). Collectives
are functional (they return a new tensor) so that both back ends are trivially correct
and the simulated one can record and check every call.

A collective is a Python call, invisible to the dispatcher; the CPU graph records only
what reaches the dispatcher (runners.graph.record). `DispatchedCollectives` therefore
issues every collective as the torch custom op `specharness::collective`, whose kernel
calls back into the communicator that issued it: a captured graph records the call and
re-issues it at replay, in the same order on every rank, through the same rank's
communicator (its traces and checks see every replay). A back end implements the
underscored methods (`_all_reduce`, ...) and inherits the public ones.
"""
from __future__ import annotations

import itertools
import weakref
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


# ---- collectives as dispatcher ops ----

_COMMS: "weakref.WeakValueDictionary[int, DispatchedCollectives]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def _handle(comm: "DispatchedCollectives") -> int:
    """A process-unique id for the op's int argument (ids of dead objects are reused; these are not)."""
    h = comm.__dict__.get("_collective_handle")
    if h is None:
        h = comm.__dict__["_collective_handle"] = next(_HANDLES)
        _COMMS[h] = comm
    return h


def _communicator(handle: int) -> "DispatchedCollectives":
    comm = _COMMS.get(handle)
    if comm is None:
        raise RuntimeError(f"communicator #{handle} is gone: a graph replayed after the ranks it was captured on finished")
    return comm


def _undispatched(comm: "DispatchedCollectives", op: str, t: torch.Tensor, group: Group, params: Sequence[int]) -> torch.Tensor:
    if op == "all_gather_v":
        return comm._all_gather_v(t, params, group)
    if op == "broadcast":
        return comm._broadcast(t, params[0], group)
    return getattr(comm, f"_{op}")(t, group)


_GROUPS = {g.value: g for g in Group}  # the op's group string back to its Group without Enum's Python lookup, per call


def _collective_kernel(t: torch.Tensor, op: str, group: str, params: list[int], comm: int) -> torch.Tensor:
    return _undispatched(_communicator(comm), op, t, _GROUPS.get(group) or Group(group), params)


def _collective_fake(t: torch.Tensor, op: str, group: str, params: list[int], comm: int) -> torch.Tensor:
    n = group_size(_communicator(comm), Group(group))
    rows = {"all_gather": n * t.shape[0] if t.dim() else 0, "reduce_scatter": t.shape[0] // n if t.dim() else 0,
            "all_gather_v": sum(params)}.get(op)
    return t.new_empty(t.shape if rows is None else (rows, *t.shape[1:]))


# A plain library op, not torch.library.custom_op: that wraps its kernel so that the first call
# imports torch._dynamo (seconds, in every fresh rank process).
LIBRARY = torch.library.Library("specharness", "FRAGMENT")
LIBRARY.define("collective(Tensor t, str op, str group, int[] params, int comm) -> Tensor")
LIBRARY.impl("collective", _collective_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("specharness::collective", _collective_fake, lib=LIBRARY)


class DispatchedCollectives:
    """The Communicator's collectives, issued through the dispatcher (see the module docstring).

    A non-tensor argument skips the op, so the back end's own validation names the mistake.
    """

    rank: int
    world_size: int

    def _issue(self, op: str, t: torch.Tensor, group: Group, params: Sequence[int] = ()) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            return _undispatched(self, op, t, group, params)
        value = group.value if type(group) is Group else Group(group).value
        return torch.ops.specharness.collective(t, op, value, [int(p) for p in params], _handle(self))

    def all_reduce(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        return self._issue("all_reduce", t, group)

    def all_gather(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        return self._issue("all_gather", t, group)

    def reduce_scatter(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        return self._issue("reduce_scatter", t, group)

    def all_gather_v(self, t: torch.Tensor, lengths: Sequence[int], group: Group) -> torch.Tensor:
        return self._issue("all_gather_v", t, group, lengths)

    def broadcast(self, t: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        return self._issue("broadcast", t, group, (src,))

    def group_ranks(self, group: Group) -> list[int]:
        raise NotImplementedError

    def _all_reduce(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        raise NotImplementedError

    def _all_gather(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        raise NotImplementedError

    def _reduce_scatter(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        raise NotImplementedError

    def _all_gather_v(self, t: torch.Tensor, lengths: Sequence[int], group: Group) -> torch.Tensor:
        raise NotImplementedError

    def _broadcast(self, t: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        raise NotImplementedError
