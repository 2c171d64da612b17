"""The spawning launcher's parent side: reads every child's messages and exits, and decides
when the launch is over (all done, a failure's grace spent, a deadlock, a timeout).
"""
from __future__ import annotations

import pickle
import time
from multiprocessing.connection import wait as mp_wait
from typing import Any, Optional

from harness.ranks.heartbeat import read_heartbeat
from harness.ranks.outcomes import (
    DistributedDeadlock,
    DistributedMismatch,
    DistributedRankFailure,
    DistributedTimeout,
    LaunchSkipped,
    exit_text,
    where_of,
)

POLL_S = 0.2  # how often the parent looks at heartbeats while some rank has finished


class Supervisor:
    """Reads every child's messages and exits, and decides when the launch is over."""

    def __init__(self, layout, backend, procs, conns, hb_paths, timeout_s, startup_timeout_s, grace_s) -> None:
        self.layout, self.backend = layout, backend
        self.ws = layout.world_size
        self.procs, self.conns, self.hb_paths = procs, conns, hb_paths
        self.timeout_s, self.startup_timeout_s, self.grace_s = timeout_s, startup_timeout_s, grace_s
        self.ready: set[int] = set()
        self.outcomes: dict[int, tuple[str, Any, list]] = {}  # rank -> (status, payload, trace)
        self.dead: dict[int, Optional[int]] = {}  # rank -> exit code, for a child gone without an outcome
        self.closed: set[int] = set()
        self.reason = ""  # "timeout" | "startup" | "deadlock" | "grace" | "" (all done)
        self.deadlock: Optional[tuple[int, int, int]] = None
        self.t0 = time.monotonic()
        self.t_all_ready: Optional[float] = None

    # ---- the loop ----
    def run(self) -> None:
        first_bad: Optional[float] = None
        while True:
            pending = [r for r in range(self.ws) if r not in self.outcomes and r not in self.dead]
            if not pending:
                return
            now = time.monotonic()
            if self.t_all_ready is None and len(self.ready) == self.ws:
                self.t_all_ready = now
            if first_bad is None and (self.dead or any(o[0] != "ok" for o in self.outcomes.values())):
                first_bad = now
            if self.t_all_ready is None:
                deadline, why = self.t0 + self.startup_timeout_s, "startup"
            else:
                deadline, why = self.t_all_ready + self.timeout_s, "timeout"
            if first_bad is not None and first_bad + self.grace_s < deadline:
                deadline, why = first_bad + self.grace_s, "grace"
            if now >= deadline:
                self.reason = why
                return
            if self.outcomes and first_bad is None:
                found = self._find_deadlock(pending)
                if found:
                    self.deadlock, self.reason = found, "deadlock"
                    return
            waitables = {}
            for r in pending:
                if r not in self.closed:
                    waitables[self.conns[r]] = ("conn", r)
                waitables[self.procs[r].sentinel] = ("exit", r)
            poll = POLL_S if self.outcomes else 1.0
            for obj in mp_wait(list(waitables), timeout=min(deadline - now, poll)):
                kind, r = waitables[obj]
                if kind == "conn":
                    self._read(r)
                elif r not in self.outcomes:
                    while r not in self.closed and r not in self.outcomes and self.conns[r].poll():
                        self._read(r)  # it may have reported just before exiting
                    if r not in self.outcomes:
                        self.procs[r].join(1.0)
                        self.dead[r] = self.procs[r].exitcode

    def _read(self, r: int) -> None:
        try:
            data = self.conns[r].recv_bytes()
        except (EOFError, OSError):
            self.closed.add(r)
            return
        msg = decode_message(data)
        if msg[0] == "ready":
            self.ready.add(r)
        else:
            _, status, payload, trace = msg
            self.outcomes[r] = (status, payload, trace)
            self.ready.add(r)

    def _find_deadlock(self, pending: list[int]) -> Optional[tuple[int, int, int]]:
        """(stuck rank, finished rank, its calls on the group) if a pending rank waits for a finished one."""
        finished = {r: o[2] for r, o in self.outcomes.items() if o[0] == "ok"}
        for r in pending:
            hb = read_heartbeat(self.hb_paths[r])
            if not hb or hb.get("state") != "entered":
                continue
            key = (hb.get("group"), tuple(hb.get("group_ranks", ())))
            for f in key[1]:
                if f in finished:
                    n = sum(1 for c in finished[f] if (c.group, tuple(c.group_ranks)) == key)
                    if n <= int(hb.get("group_seq", 0)):
                        return r, f, n
        return None

    # ---- reporting ----
    def all_ok(self) -> bool:
        return len(self.outcomes) == self.ws and all(o[0] == "ok" for o in self.outcomes.values())

    def states(self) -> dict[int, str]:
        """One line per rank: what it was doing when the launch ended."""
        out: dict[int, str] = {}
        for r in range(self.ws):
            hb = read_heartbeat(self.hb_paths[r])
            where = where_of(hb)
            if r in self.outcomes:
                status, payload, _ = self.outcomes[r]
                if status == "ok":
                    out[r] = "finished"
                elif status == "skip":
                    out[r] = f"skipped: {payload}"
                else:
                    summary = "CollectiveMismatch (above)" if payload["mismatch"] else payload["summary"]
                    out[r] = f"failed: {summary}" + (f" (in {where})" if where else "")
            elif r in self.dead:
                out[r] = f"died without reporting: {exit_text(self.dead[r])}" + (f" (last: {where})" if where else "")
            elif not hb or hb.get("state") == "starting":
                out[r] = "starting (process group not joined yet)"
            elif hb.get("state") == "entered":
                out[r] = f"stuck in {where}"
            elif hb.get("state") == "left":
                out[r] = f"running fn, outside collectives; last: {where}"
            else:
                out[r] = "running fn, no collective yet"
        return out

    def error(self, states: dict[int, str], elapsed: float) -> BaseException:
        ctx = f"{self.ws} ranks, backend {self.backend}, layout {self.layout.describe()}"
        lines = "\n".join(f"  rank {r}: {s}" for r, s in states.items())
        failures = {r: o[1]["traceback"] for r, o in self.outcomes.items() if o[0] == "error"}
        failures.update({r: f"exited without reporting: {exit_text(c)}" for r, c in self.dead.items()})
        if failures:
            mismatches = [o[1]["message"] for o in self.outcomes.values() if o[0] == "error" and o[1]["mismatch"]]
            tbs = "\n".join(f"--- rank {r} ---\n{failures[r].rstrip()}" for r in sorted(failures))
            head = mismatches[0] if mismatches else f"rank(s) {', '.join(map(str, sorted(failures)))} failed"
            cls = DistributedMismatch if mismatches else DistributedRankFailure
            killed = [r for r in range(self.ws) if r not in self.outcomes and r not in self.dead]
            if killed:
                ctx += f"; rank(s) {', '.join(map(str, killed))} killed after the {self.grace_s:g} s grace"
            return cls(f"{head}\n({ctx})\n{lines}\n{tbs}", failures, states)
        skips = {r: o[1] for r, o in self.outcomes.items() if o[0] == "skip"}
        if skips:
            r0 = min(skips)
            more = f" (ranks {sorted(skips)} skipped)" if len(skips) > 1 else ""
            return LaunchSkipped(f"rank {r0}: {skips[r0]}{more}", tuple(sorted(skips)))
        if self.reason == "deadlock" and self.deadlock:
            r, f, n = self.deadlock
            return DistributedDeadlock(
                f"deadlock after {elapsed:.1f} s: rank {r} waits in a collective for rank {f}, which returned from fn "
                f"after {n} call(s) on that group\n({ctx})\n{lines}",
                states,
            )
        if self.reason == "startup":
            return DistributedTimeout(f"ranks did not all join the process group within {self.startup_timeout_s:g} s ({ctx})\n{lines}", states)
        return DistributedTimeout(
            f"timed out: not every rank finished within timeout_s={self.timeout_s:g} s of joining the process group "
            f"({elapsed:.1f} s in all; {ctx})\n{lines}",
            states,
        )


def decode_message(data: bytes) -> tuple:
    return pickle.loads(data)
