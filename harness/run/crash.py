"""A rank failure as a property result: the root exception's name and one line of detail, the same for simulated and real ranks."""
from __future__ import annotations

from typing import Callable

from harness.ranks.launcher import DistributedDeadlock, DistributedRankFailure
from harness.ranks.simulated import RankFailure
from harness.ranks.trace import CollectiveMismatch, CollectiveTimeout
from harness.verdict import Verdict


def crash_name(err: BaseException) -> str:
    """The root exception's type name, the same for simulated and real ranks.

    Real ranks: DistributedMismatch -> CollectiveMismatch; DistributedDeadlock (a rank waits
    for one that returned from fn: the simulated ranks' "returned without calling", a
    detected desync, nothing slow) -> CollectiveMismatch; any other DistributedTimeout ->
    CollectiveTimeout (never a kill); DistributedRankFailure -> the failed rank's exception
    type, read from its traceback.
    """
    if isinstance(err, RankFailure):
        return type(err.root_exception).__name__
    if isinstance(err, (CollectiveMismatch, DistributedDeadlock)):
        return "CollectiveMismatch"
    if isinstance(err, CollectiveTimeout):
        return "CollectiveTimeout"
    if isinstance(err, DistributedRankFailure) and err.failures:
        last = err.failures[min(err.failures)].strip().splitlines()[-1:] or [""]
        name = last[0].split(":", 1)[0].rsplit(".", 1)[-1].strip()
        return name if name.isidentifier() else type(err).__name__
    return type(err).__name__


def crash_detail(err: BaseException) -> str:
    """One line: the error's first line, plus (real ranks) every unfinished rank's state."""
    head = str(err).splitlines()[0] if str(err) else type(err).__name__
    states = getattr(err, "states", None) or {}
    rest = [f"rank {r}: {s}" for r, s in sorted(states.items()) if s != "finished"]
    return head + (" | " + "; ".join(rest) if rest else "")


def crash_verdict(prop: str, where: dict, err: BaseException) -> Verdict:
    """A rank failing is a finding (a collective mismatch is a detected desync); `got` names the
    root exception type so the mutant report can tell a timeout (never a kill) from a crash."""
    v = Verdict(prop)
    v.fail("run", "ranks", where, "every rank completes", crash_name(err), crash_detail(err))
    return v


def guarded(name: str, fn: Callable[[], dict[str, Verdict]]) -> Callable[[], dict[str, Verdict]]:
    """A probe that never raises: an exception anywhere (a rank, an oracle, the harness) is a "run" failure naming it."""

    def probe() -> dict[str, Verdict]:
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - reported, never swallowed
            return {"run": crash_verdict("run", {"probe": name}, err)}

    probe.__name__ = f"probe_{name.replace('-', '_')}"
    return probe
