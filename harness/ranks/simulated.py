"""Simulated ranks: a layout's SPMD ranks as threads of one process.

Why threads and not processes: the harness needs to run every layout (world sizes 1..8)
on a laptop CPU in milliseconds, check every collective call against every peer's, and
report a desynchronised rank by name instead of hanging like NCCL would. Threads share
memory, so a collective is a rendezvous on a condition variable plus a pure combine step.

Matching rule: the k-th call a rank makes on a *group instance* (the tuple of global
ranks, e.g. ATTN_TP of DP group 1 = (2, 3)) meets the k-th call of every other member
of that instance. Two group names over the same ranks (WORLD and ATTN_TP without DP
attention) share one counter, so one rank calling WORLD where a peer calls ATTN_TP is a
mismatch (on real ranks they are two communicators and it would hang). Each rendezvous ("slot") checks op, group name, shape and dtype (and
`lengths` / `src`) against the first member to arrive, so a desynchronised rank fails
fast with both sides' descriptions.

Failure semantics (what every waiter sees, never a hang inside a collective):
- members disagree                    -> CollectiveMismatch on every member of the slot;
- a missing member raised in fn       -> PeerFailed ("peer rank R failed: ...") at once;
- a missing member returned from fn   -> CollectiveMismatch ("rank R returned from fn
                                         without calling ...") at once. It is a mismatch,
                                         not a timeout: the rank's collective sequence is
                                         shorter than its peers', and nothing is slow;
- every live rank waits and no slot can complete (e.g. two ranks order collectives on
  two groups differently)             -> CollectiveMismatch ("deadlock: ...") at once;
- a missing member is still running past timeout_s -> CollectiveTimeout on the waiter
  that hit its deadline (its slot-mates get PeerFailed pointing at it).

Reductions run once, on the thread of the last member to arrive, summing in group-rank
order; every member gets its own clone, so all members see bitwise-identical results
and no rank ever holds a peer's tensor object. Inputs are detached first: simulated
collectives never link autograd graphs across ranks (the harness is inference-only).

A rank stuck outside collectives (an infinite loop in fn) cannot be interrupted from
Python; run() joins every thread, so such a bug surfaces through pytest-timeout.
"""
from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, TypeVar

import torch

from harness.ranks.trace import CollectiveCall, CollectiveError, CollectiveMismatch, CollectiveTimeout
from runners.parallel.comm import DispatchedCollectives, Group
from runners.parallel.layout import ParallelLayout

T = TypeVar("T")

BARRIER_DTYPE = ""  # a barrier carries no tensor: recorded with shape () and dtype "" (as harness.ranks.distributed does)


class PeerFailed(CollectiveError):
    """A collective abandoned because a peer failed; a consequence, never a root cause."""

    def __init__(self, peer: int, cause: str) -> None:
        super().__init__(f"peer rank {peer} failed: {cause}")
        self.peer = peer


class RankFailure(RuntimeError):
    """One or more ranks raised in fn. The message leads with the root cause.

    failures: rank -> (exception, formatted traceback), for every rank that raised.
    root_rank: the first rank to fail on its own (not with PeerFailed); falls back to the
    first rank to fail when every failure is a consequence of another.
    """

    def __init__(self, failures: dict[int, tuple[BaseException, str]], order: Sequence[int]) -> None:
        own = [r for r in order if not _is_consequence(failures[r][0])]
        self.root_rank = own[0] if own else order[0]
        self.failures = dict(sorted(failures.items()))
        root_exc, root_tb = failures[self.root_rank]
        lines = [f"rank {self.root_rank} failed: {_exc_line(root_exc)}"]
        others = [r for r in self.failures if r != self.root_rank]
        if others:
            lines.append("other failed ranks:")
            lines += [f"  rank {r}: {_exc_line(self.failures[r][0])}" for r in others]
        lines.append(f"traceback of rank {self.root_rank}:")
        lines.append(root_tb.rstrip())
        super().__init__("\n".join(lines))

    @property
    def root_exception(self) -> BaseException:
        return self.failures[self.root_rank][0]


def _exc_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _is_consequence(exc: BaseException) -> bool:
    """True when exc is (or was raised while handling / from) a PeerFailed."""
    seen: set[int] = set()
    cur: Optional[BaseException] = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, PeerFailed):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


# ---------------------------------------------------------------- combine steps
# Pure functions: contributions in group-rank order -> one fresh output per member.


def _sum_in_order(ts: list[torch.Tensor]) -> torch.Tensor:
    acc = ts[0].clone()
    for t in ts[1:]:
        acc.add_(t)
    return acc


def _combine_all_reduce(ts: list[torch.Tensor], params: tuple) -> list[torch.Tensor]:
    acc = _sum_in_order(ts)
    return [acc.clone() for _ in ts]


def _combine_all_gather(ts: list[torch.Tensor], params: tuple) -> list[torch.Tensor]:
    full = torch.cat(ts, dim=0)
    return [full.clone() for _ in ts]


def _combine_reduce_scatter(ts: list[torch.Tensor], params: tuple) -> list[torch.Tensor]:
    acc = _sum_in_order(ts)
    chunk = acc.shape[0] // len(ts)
    return [acc[i * chunk : (i + 1) * chunk].clone() for i in range(len(ts))]


def _combine_all_gather_v(ts: list[torch.Tensor], params: tuple) -> list[torch.Tensor]:
    (lengths,) = params
    full = torch.cat([t[:n] for t, n in zip(ts, lengths, strict=True)], dim=0)
    return [full.clone() for _ in ts]


def _combine_broadcast(ts: list[torch.Tensor], params: tuple) -> list[torch.Tensor]:
    (src,) = params
    return [ts[src].clone() for _ in ts]


def _combine_barrier(ts: list[Optional[torch.Tensor]], params: tuple) -> list[None]:
    return [None for _ in ts]


Combine = Callable[[list, tuple], list]


# ---------------------------------------------------------------- world state


def _param_text(op: str, params: tuple) -> str:
    if op == "all_gather_v":
        return f" with lengths={list(params[0])}"
    if op == "broadcast":
        return f" with src={params[0]}"
    return ""


@dataclass
class _Arrival:
    call: CollectiveCall
    tensor: Optional[torch.Tensor]
    params: tuple

    def describe(self) -> str:
        return self.call.describe() + _param_text(self.call.op, self.params)


@dataclass
class _Slot:
    """One rendezvous: the k-th collective of one group instance."""

    ranks: tuple[int, ...]
    k: int
    group: str
    arrivals: dict[int, _Arrival] = field(default_factory=dict)
    first: Optional[int] = None  # the rank every later arrival is checked against
    done: bool = False
    results: dict[int, Optional[torch.Tensor]] = field(default_factory=dict)
    error: Optional[tuple[type[CollectiveError], str, Optional[int]]] = None  # (class, message, origin rank)

    @property
    def label(self) -> str:
        return f"collective #{self.k} of group {self.group}(ranks {','.join(map(str, self.ranks))})"

    @property
    def pending(self) -> bool:
        return not self.done and self.error is None

    def missing(self) -> list[int]:
        return [r for r in self.ranks if r not in self.arrivals]

    def fail(self, cls: type[CollectiveError], message: str, origin: Optional[int] = None) -> None:
        if self.error is None:
            self.error = (cls, message, origin)

    def error_for(self, rank: int) -> CollectiveError:
        """A fresh exception per rank (tracebacks are per thread); slot-mates of a timed-out rank get PeerFailed."""
        assert self.error is not None
        cls, message, origin = self.error
        if origin is not None and origin != rank:
            return PeerFailed(origin, f"{cls.__name__}: {message}")
        return cls(message)


@dataclass
class _RankState:
    status: str = "running"  # running | returned | raised
    exc: Optional[BaseException] = None
    slot: Optional[_Slot] = None  # the slot this rank is blocked in, if any
    trace: list[CollectiveCall] = field(default_factory=list)
    group_seq: dict[tuple[int, ...], int] = field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.status != "running"

    @property
    def blocked(self) -> bool:
        return self.status == "running" and self.slot is not None and self.slot.pending


class SimulatedWorld:
    """The ranks of one layout, run as threads. All state is per world (rank-indexed)."""

    def __init__(self, layout: ParallelLayout, timeout_s: float = 30.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 (got {timeout_s})")
        self.layout = layout
        self.world_size = layout.world_size
        self.timeout_s = timeout_s
        self.traces: list[list[CollectiveCall]] = []
        self._cond = threading.Condition()
        self._running = False
        self._reset()

    def _reset(self) -> None:
        self._ranks = [_RankState() for _ in range(self.world_size)]
        self._slots: dict[tuple[tuple[int, ...], int], _Slot] = {}
        self._results: dict[int, object] = {}
        self._failures: dict[int, tuple[BaseException, str]] = {}
        self._fail_order: list[int] = []

    # ---- launch ----
    def run(self, fn: Callable[["SimComm"], T]) -> list[T]:
        """Run fn(comm) on every rank, each in its own thread (SPMD); return per-rank results in rank order.

        Raises RankFailure if any rank raised. Every thread has finished when this returns
        or raises; `traces` holds this run's per-rank collective calls either way.
        """
        with self._cond:
            if self._running:
                raise RuntimeError("SimulatedWorld.run is already running: one run per world at a time")
            self._running = True
            self._reset()
        threads = [
            threading.Thread(target=self._rank_main, args=(r, fn), name=f"simrank-{r}/{self.world_size}", daemon=True)
            for r in range(self.world_size)
        ]
        started: list[threading.Thread] = []
        try:
            for t in threads:
                t.start()
                started.append(t)
        except BaseException as exc:
            # Ranks that never started count as raised, so started peers fail fast instead of waiting.
            for r in range(len(started), self.world_size):
                self._finish(r, exc, traceback.format_exc())
            raise
        finally:
            for t in started:
                t.join()
            with self._cond:
                self.traces = [list(st.trace) for st in self._ranks]
                self._running = False
        if self._failures:
            raise RankFailure(self._failures, self._fail_order)
        return [self._results[r] for r in range(self.world_size)]  # type: ignore[misc]

    def _rank_main(self, rank: int, fn: Callable[["SimComm"], T]) -> None:
        try:
            value = fn(SimComm(self, rank))
        except BaseException as exc:  # reported through RankFailure, including KeyboardInterrupt/SystemExit in fn
            self._finish(rank, exc, traceback.format_exc())
            return
        with self._cond:
            self._results[rank] = value
            self._ranks[rank].status = "returned"
            self._cond.notify_all()

    def _finish(self, rank: int, exc: BaseException, tb: str) -> None:
        with self._cond:
            st = self._ranks[rank]
            st.status, st.exc = "raised", exc
            self._failures[rank] = (exc, tb)
            self._fail_order.append(rank)
            self._cond.notify_all()

    # ---- collectives ----
    def _collective(
        self,
        rank: int,
        op: str,
        group: Group,
        tensor: Optional[torch.Tensor],
        params: tuple,
        combine: Combine,
    ) -> Optional[torch.Tensor]:
        """Record the call, meet the group's other members, return this member's fresh output."""
        ranks = tuple(self.layout.group_ranks(group, rank))
        with self._cond:
            if not self._running:
                raise RuntimeError(f"rank {rank} called {op} outside SimulatedWorld.run (a SimComm is only valid inside fn)")
            st = self._ranks[rank]
            k = st.group_seq.get(ranks, 0)
            st.group_seq[ranks] = k + 1
            call = CollectiveCall.of(len(st.trace), op, group.value, ranks, tensor)
            st.trace.append(call)
            slot = self._slots.setdefault((ranks, k), _Slot(ranks=ranks, k=k, group=group.value))
            try:
                self._arrive(slot, rank, _Arrival(call, tensor, params), combine)
            finally:
                self._cond.notify_all()
            st.slot = slot
            try:
                return self._await(rank, slot)
            finally:
                st.slot = None

    def _arrive(self, slot: _Slot, rank: int, arrival: _Arrival, combine: Combine) -> None:
        slot.arrivals[rank] = arrival
        if slot.first is None:
            slot.first = rank
        elif slot.error is None:
            ref = slot.arrivals[slot.first]
            if not _consistent(ref, arrival):
                slot.fail(
                    CollectiveMismatch,
                    f"rank {rank} called {arrival.describe()} where rank {slot.first} called {ref.describe()} [{slot.label}]",
                )
        if slot.error is None and not slot.missing():
            ordered = [slot.arrivals[r] for r in slot.ranks]
            try:
                outputs = combine([a.tensor for a in ordered], ordered[0].params)
            except Exception as exc:
                message = f"{arrival.call.op} failed to combine [{slot.label}]: {_exc_line(exc)}"
                slot.fail(CollectiveError, message)
                raise CollectiveError(message) from exc
            slot.results = dict(zip(slot.ranks, outputs, strict=True))
            slot.done = True

    def _await(self, rank: int, slot: _Slot) -> Optional[torch.Tensor]:
        deadline = time.monotonic() + self.timeout_s
        while True:
            if slot.error is not None:
                raise slot.error_for(rank)
            if slot.done:
                out = slot.results.pop(rank)
                if not slot.results:
                    del self._slots[(slot.ranks, slot.k)]
                return out
            doomed = self._doomed(slot)
            if doomed is not None:
                raise doomed
            if self._deadlocked():
                message = self._deadlock_message()
                for st in self._ranks:
                    if st.blocked and st.slot is not None:
                        st.slot.fail(CollectiveMismatch, message)
                slot.fail(CollectiveMismatch, message)
                self._cond.notify_all()
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                slot.fail(CollectiveTimeout, self._timeout_message(rank, slot), origin=rank)
                self._cond.notify_all()
                continue
            self._cond.wait(remaining)

    def _doomed(self, slot: _Slot) -> Optional[CollectiveError]:
        """The error for a slot a finished member will never join (raised peers first: they are likelier root causes)."""
        missing = [(r, self._ranks[r]) for r in slot.missing()]
        for r, st in missing:
            if st.status == "raised":
                return PeerFailed(r, _exc_line(st.exc))  # type: ignore[arg-type]
        ref = slot.arrivals[slot.first].describe() if slot.first is not None else "?"
        for r, st in missing:
            if st.status == "returned":
                return CollectiveMismatch(
                    f"rank {r} returned from fn without calling {ref} [{slot.label}]; arrived: ranks {sorted(slot.arrivals)}"
                )
        return None

    def _deadlocked(self) -> bool:
        """No live rank can make progress: every one is blocked in a slot, and no slot is doomed (that error is more precise)."""
        blocked = [st for st in self._ranks if st.blocked]
        if not blocked or any(not st.terminal and not st.blocked for st in self._ranks):
            return False
        return all(st.slot is not None and self._doomed(st.slot) is None for st in blocked)

    def _deadlock_message(self) -> str:
        parts = [f"rank {r} {self._doing(r)}" for r in range(self.world_size)]
        return "deadlock: every live rank waits in a collective no peer will join: " + "; ".join(parts)

    def _timeout_message(self, rank: int, slot: _Slot) -> str:
        missing = ", ".join(f"rank {r} ({self._doing(r)})" for r in slot.missing())
        return (
            f"rank {rank} waited more than {self.timeout_s:g}s in {slot.arrivals[rank].describe()} [{slot.label}]: "
            f"arrived: ranks {sorted(slot.arrivals)}; never arrived: {missing}"
        )

    def _doing(self, rank: int) -> str:
        """What a rank is doing, for timeout and deadlock reports."""
        st = self._ranks[rank]
        if st.status == "returned":
            return "returned from fn"
        if st.status == "raised":
            return f"raised {_exc_line(st.exc)}"  # type: ignore[arg-type]
        if st.slot is not None and st.slot.pending:
            return f"waiting in {st.slot.arrivals[rank].describe()} [{st.slot.label}], missing ranks {st.slot.missing()}"
        if st.trace:
            return f"running; last collective call #{st.trace[-1].seq}: {st.trace[-1].describe()}"
        return "running; no collective called yet"


def _consistent(a: _Arrival, b: _Arrival) -> bool:
    ca, cb = a.call, b.call
    if (ca.op, ca.group, ca.dtype, a.params) != (cb.op, cb.group, cb.dtype, b.params):
        return False
    if ca.op == "all_gather_v":
        return len(ca.shape) == len(cb.shape) and ca.shape[1:] == cb.shape[1:]
    return ca.shape == cb.shape


# ---------------------------------------------------------------- per-rank communicator


class SimComm(DispatchedCollectives):
    """One rank's view of a SimulatedWorld; implements runners.parallel.comm.Communicator."""

    def __init__(self, world: SimulatedWorld, rank: int) -> None:
        self._world = world
        self.rank = rank
        self.world_size = world.world_size

    def group_ranks(self, group: Group) -> list[int]:
        return self._world.layout.group_ranks(Group(group), self.rank)

    def _run(self, op: str, t: Optional[torch.Tensor], group: Group, params: tuple, combine: Combine):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: expected a torch.Tensor, got {type(t).__name__}")
        return self._world._collective(
            self.rank, op, Group(group), t.detach() if t is not None else None, params, combine
        )

    def _need_dim0(self, op: str, t: torch.Tensor) -> None:
        if t.dim() == 0:
            raise ValueError(f"rank {self.rank}: {op} needs a tensor with a dim 0 (got a 0-d tensor)")

    def _all_reduce(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        return self._run("all_reduce", t, group, (), _combine_all_reduce)

    def _all_gather(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        self._need_dim0("all_gather", t)
        return self._run("all_gather", t, group, (), _combine_all_gather)

    def _reduce_scatter(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        self._need_dim0("reduce_scatter", t)
        size = len(self.group_ranks(group))
        if t.shape[0] % size:
            raise ValueError(
                f"rank {self.rank}: reduce_scatter over {Group(group).value} needs dim 0 ({t.shape[0]}) divisible by the group size ({size})"
            )
        return self._run("reduce_scatter", t, group, (), _combine_reduce_scatter)

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
        return self._run("all_gather_v", t, group, (lengths,), _combine_all_gather_v)

    def _broadcast(self, t: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        size = len(self.group_ranks(group))
        if not 0 <= src < size:
            raise ValueError(f"rank {self.rank}: broadcast src is a group rank in 0..{size - 1}, got {src}")
        return self._run("broadcast", t, group, (int(src),), _combine_broadcast)

    def barrier(self, group: Group) -> None:
        self._run("barrier", None, group, (), _combine_barrier)


# ---------------------------------------------------------------- helpers


def run_spmd(
    layout: ParallelLayout, fn: Callable[[SimComm], T], timeout_s: float = 30.0
) -> tuple[list[T], list[list[CollectiveCall]]]:
    """Run fn on a fresh SimulatedWorld; return (per-rank results, per-rank traces)."""
    world = SimulatedWorld(layout, timeout_s=timeout_s)
    results = world.run(fn)
    return results, world.traces


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


__all__ = [
    "BARRIER_DTYPE",
    "PeerFailed",
    "RankFailure",
    "SimComm",
    "SimulatedWorld",
    "compare_traces",
    "run_spmd",
]
