"""What a launched rank posts back to rank 0 (harness.ranks.joined), and the one error rank 0
raises when not every rank finished: the same classes the spawning launcher raises, so
verdicts name a joined failure exactly as they name a spawned one (harness.run.crash.crash_name).

Root causes first: a rank that raised on its own is the failure; a rank whose collective
failed because a peer closed its sockets (it failed, or returned from fn while this rank
still waited for it) is a consequence, named in the states only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from harness.ranks.outcomes import (
    DistributedDeadlock,
    DistributedMismatch,
    DistributedRankFailure,
    DistributedTimeout,
    LaunchSkipped,
)
from harness.ranks.trace import CollectiveCall

# gloo's words for a peer that went away, and for a wait past the process group's timeout
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
TIMED_OUT = ("Timed out waiting", "timed out after", "Timeout waiting")


@dataclass
class Outcome:
    rank: int
    status: str  # "ok" | "skip" | "error"
    payload: Any  # ok: fn's result; skip: the reason; error: harness.ranks.outcomes.error_payload
    trace: list[CollectiveCall] = field(default_factory=list)
    where: str = ""  # its last collective, from its heartbeat ("" before the first)

    def _says(self, words: tuple[str, ...]) -> bool:
        return self.status == "error" and any(w in self.payload["message"] for w in words)

    @property
    def peer_lost(self) -> bool:
        return self._says(PEER_LOST)

    @property
    def timed_out(self) -> bool:
        return self._says(TIMED_OUT) and not self.peer_lost

    @property
    def own_failure(self) -> bool:
        return self.status == "error" and not self.peer_lost and not self.timed_out

    def state(self) -> str:
        at = f" (in {self.where})" if self.where else " (before any collective)"
        if self.status == "ok":
            return "finished"
        if self.status == "skip":
            return f"skipped: {self.payload}"
        if self.peer_lost:
            return f"lost its peer while in {self.where or 'the process group'}"
        if self.timed_out:
            return f"timed out in {self.where or 'the process group'}"
        summary = "CollectiveMismatch (above)" if self.payload["mismatch"] else self.payload["summary"]
        return f"failed: {summary}{at}"


def _state(o: Optional[Outcome]) -> str:
    return o.state() if o is not None else "no outcome: its process died, or is still stuck"


def launch_error(outcomes: list[Optional[Outcome]], ctx: str, elapsed: float) -> BaseException:
    """The error for a job where not every rank finished (outcomes[r] None: rank r posted nothing)."""
    states = {r: _state(o) for r, o in enumerate(outcomes)}
    lines = "\n".join(f"  rank {r}: {s}" for r, s in states.items())
    own = {r: o for r, o in enumerate(outcomes) if o is not None and o.own_failure}
    if own:
        mismatches = [o.payload["message"] for o in own.values() if o.payload["mismatch"]]
        failures = {r: o.payload["traceback"] for r, o in own.items()}
        head = mismatches[0] if mismatches else "; ".join(
            f"rank {r} failed {'in ' + o.where if o.where else 'before any collective'}: {o.payload['summary']}" for r, o in own.items())
        tbs = "\n".join(f"--- rank {r} ---\n{tb.rstrip()}" for r, tb in failures.items())
        cls = DistributedMismatch if mismatches else DistributedRankFailure
        return cls(f"{head}\n({ctx})\n{lines}\n{tbs}", failures, states)
    skips = {r: o.payload for r, o in enumerate(outcomes) if o is not None and o.status == "skip"}
    if skips:
        r0 = min(skips)
        more = f" (ranks {sorted(skips)} skipped)" if len(skips) > 1 else ""
        return LaunchSkipped(f"rank {r0}: {skips[r0]}{more}", tuple(sorted(skips)))
    finished = [r for r, o in enumerate(outcomes) if o is not None and o.status == "ok"]
    stuck = [r for r, o in enumerate(outcomes) if o is not None and o.peer_lost]
    if stuck and finished:
        r = stuck[0]
        return DistributedDeadlock(
            f"deadlock after {elapsed:.1f} s: rank {r} waits in {outcomes[r].where or 'a collective'} for rank(s) "  # type: ignore[union-attr]
            f"{', '.join(map(str, finished))}, which returned from fn\n({ctx})\n{lines}", states)
    silent = [r for r, o in enumerate(outcomes) if o is None]
    if silent and not any(o is not None and o.timed_out for o in outcomes):
        failures = {r: states[r] for r in silent}
        return DistributedRankFailure(f"rank(s) {', '.join(map(str, silent))} posted no outcome\n({ctx})\n{lines}", failures, states)
    return DistributedTimeout(f"timed out: not every rank finished within the process group's timeout ({elapsed:.1f} s in all; {ctx})\n{lines}", states)
