"""Simulated ranks: a layout's SPMD ranks as threads of one process.

Why threads and not processes: the harness needs to run every layout (world sizes 1..8)
on a laptop CPU in milliseconds, check every collective call against every peer's, and
report a desynchronised rank by name instead of hanging like NCCL would. Threads share
memory, so a collective is a rendezvous on a condition variable plus a pure combine step.
Each rendezvous has its own condition over the world's one lock: an arrival wakes only the
members of its own collective, and only when it completes or fails it, so a collective of a
world of W ranks costs O(W) wake-ups rather than O(W^2); what can doom any waiting rank (a
rank returning or raising, a deadlock) wakes every rendezvous.

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

import contextlib
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, TypeVar

import torch

from harness.ranks.one_cpu import threads_on_one_cpu
from harness.ranks.sim_combine import Combine
from harness.ranks.sim_comm import SimComm
from harness.ranks.sim_failures import PeerFailed, RankFailure, exc_line
from harness.ranks.trace import CollectiveCall, CollectiveError, CollectiveMismatch, CollectiveTimeout, compare_traces
from runners.parallel.comm import Group
from runners.parallel.layout import ParallelLayout

T = TypeVar("T")

# The interpreter's switch interval while ranks run: a rank hands the GIL over whenever it waits in a collective, which
# is how ranks take turns; the default 5 ms forced switch between runnable ranks only adds context switches (in worlds
# of 16 or 32 ranks, most of the run's system time). A rank that never waits still yields every 100 ms.
RANK_SWITCH_INTERVAL_S = 0.1

BARRIER_DTYPE = ""  # a barrier carries no tensor: recorded with shape () and dtype "" (as harness.ranks.distributed does)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Simulated ranks are threads running tiny ops: torch's intra-op pool only spins (5x the CPU time for the same
    results on a 2-core machine), and a reduction split over however many pool threads are free that moment sums in
    another order, so two runs of one rank could differ in their last bits. Scoped, restored after. Each rank thread
    sets it again for itself (_rank_main): MKL's thread count is per thread, and torch applies its own to a new thread
    only at the thread's first parallel op, so a matmul before that split over every core and summed in another order
    than the same matmul later in the run."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


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
    cond: threading.Condition  # over the world's lock: wakes this rendezvous's members alone
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
        self._group_ranks: dict[tuple[Group, int], tuple[int, ...]] = {}  # (group, rank) -> its instance: a layout is immutable
        self._lock = threading.Lock()
        self._running = False
        self._reset()

    def _reset(self) -> None:
        self._ranks = [_RankState() for _ in range(self.world_size)]
        self._slots: dict[tuple[tuple[int, ...], int], _Slot] = {}
        self._results: dict[int, object] = {}
        self._failures: dict[int, tuple[BaseException, str]] = {}

    # ---- launch ----
    def run(self, fn: Callable[["SimComm"], T]) -> list[T]:
        """Run fn(comm) on every rank, each in its own thread (SPMD); return per-rank results in rank order.

        Raises RankFailure if any rank raised. Every thread has finished when this returns
        or raises; `traces` holds this run's per-rank collective calls either way.
        """
        with self._lock:
            if self._running:
                raise RuntimeError("SimulatedWorld.run is already running: one run per world at a time")
            self._running = True
            self._reset()
        with one_torch_thread():
            return self._run_threads(fn)

    def _run_threads(self, fn: Callable[["SimComm"], T]) -> list[T]:
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(max(switch_interval, RANK_SWITCH_INTERVAL_S))
        threads = [
            threading.Thread(target=self._rank_main, args=(r, fn), name=f"simrank-{r}/{self.world_size}", daemon=True)
            for r in range(self.world_size)
        ]
        started: list[threading.Thread] = []
        try:
            with threads_on_one_cpu():  # they take turns at every collective: on two CPUs they only ping-pong the GIL
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
            with self._lock:
                self.traces = [list(st.trace) for st in self._ranks]
                self._running = False
            sys.setswitchinterval(switch_interval)
        if self._failures:
            raise RankFailure(self._failures)
        return [self._results[r] for r in range(self.world_size)]  # type: ignore[misc]

    def _rank_main(self, rank: int, fn: Callable[["SimComm"], T]) -> None:
        torch.set_num_threads(1)  # this thread's MKL and OpenMP count too (one_torch_thread)
        try:
            value = fn(SimComm(self, rank))
        except BaseException as exc:  # reported through RankFailure, including KeyboardInterrupt/SystemExit in fn
            self._finish(rank, exc, traceback.format_exc())
            return
        with self._lock:
            self._results[rank] = value
            self._ranks[rank].status = "returned"
            self._wake_everyone()

    def _finish(self, rank: int, exc: BaseException, tb: str) -> None:
        with self._lock:
            st = self._ranks[rank]
            st.status, st.exc = "raised", exc
            self._failures[rank] = (exc, tb)
            self._wake_everyone()

    def _wake_everyone(self) -> None:
        """A rank's end can doom any waiting rendezvous (or leave the rest deadlocked): every waiter re-checks."""
        for slot in self._slots.values():
            slot.cond.notify_all()

    # ---- collectives ----
    def group_instance(self, group: Group, rank: int) -> tuple[int, ...]:
        """The global ranks of `rank`'s instance of `group`, in group-rank order (the layout's group_ranks, kept)."""
        ranks = self._group_ranks.get((group, rank))
        if ranks is None:
            ranks = self._group_ranks[(group, rank)] = tuple(self.layout.group_ranks(group, rank))
        return ranks

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
        ranks = self.group_instance(group, rank)
        with self._lock:
            if not self._running:
                raise RuntimeError(f"rank {rank} called {op} outside SimulatedWorld.run (a SimComm is only valid inside fn)")
            st = self._ranks[rank]
            k = st.group_seq.get(ranks, 0)
            st.group_seq[ranks] = k + 1
            call = CollectiveCall.of(len(st.trace), op, group.value, ranks, tensor)
            st.trace.append(call)
            slot = self._slots.get((ranks, k))
            if slot is None:
                slot = self._slots[(ranks, k)] = _Slot(ranks=ranks, k=k, group=group.value, cond=threading.Condition(self._lock))
            try:
                self._arrive(slot, rank, _Arrival(call, tensor, params), combine)
            finally:
                if not slot.pending:  # complete or failed: its members stop waiting; an arrival short of that wakes no one
                    slot.cond.notify_all()
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
        if slot.error is None and len(slot.arrivals) == len(slot.ranks):  # every member arrived (each arrives once, in its own ranks)
            ordered = [slot.arrivals[r] for r in slot.ranks]
            try:
                outputs = combine([a.tensor for a in ordered], ordered[0].params)
            except Exception as exc:
                message = f"{arrival.call.op} failed to combine [{slot.label}]: {exc_line(exc)}"
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
                self._wake_everyone()
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                slot.fail(CollectiveTimeout, self._timeout_message(rank, slot), origin=rank)
                slot.cond.notify_all()
                continue
            slot.cond.wait(remaining)

    def _doomed(self, slot: _Slot) -> Optional[CollectiveError]:
        """The error for a slot a finished member will never join (raised peers first: they are likelier root causes)."""
        missing = [(r, self._ranks[r]) for r in slot.missing()]
        for r, st in missing:
            if st.status == "raised":
                return PeerFailed(r, exc_line(st.exc))  # type: ignore[arg-type]
        for r, st in missing:
            if st.status == "returned":
                ref = slot.arrivals[slot.first].describe() if slot.first is not None else "?"
                return CollectiveMismatch(
                    f"rank {r} returned from fn without calling {ref} [{slot.label}]; arrived: ranks {sorted(slot.arrivals)}"
                )
        return None

    def _deadlocked(self) -> bool:
        """No live rank can make progress: every one is blocked in a slot, and no slot is doomed (that error is more precise)."""
        # asked by every waiting arrival: one pass that stops at the first rank still running free (the usual answer)
        blocked: list[_Slot] = []
        for st in self._ranks:
            if st.status == "running":
                if st.slot is None or not st.slot.pending:
                    return False
                blocked.append(st.slot)
        return bool(blocked) and all(self._doomed(slot) is None for slot in blocked)

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
            return f"raised {exc_line(st.exc)}"  # type: ignore[arg-type]
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


__all__ = [
    "BARRIER_DTYPE",
    "PeerFailed",
    "RankFailure",
    "SimComm",
    "SimulatedWorld",
    "compare_traces",
]
