"""One way to run a function on every rank of a layout: simulated (threads) or real (a process per rank).

Every caller that runs a scenario on ranks goes through `run`, so the choice of ranks is one
argument and both kinds hand back the same thing: per-rank results and per-rank collective traces.
"""
from __future__ import annotations

from typing import Any, Callable

from harness.ranks.kinds import RanksKind
from harness.ranks.launcher import launch
from harness.ranks.simulated import SimulatedWorld
from harness.ranks.trace import CollectiveCall
from runners.parallel.layout import ParallelLayout


def run(layout: ParallelLayout, fn: Callable[..., Any], *args: Any, ranks: RanksKind | str = RanksKind.SIM, timeout_s: float = 60.0,
        **launch_kw: Any) -> tuple[list[Any], list[list[CollectiveCall]]]:
    """fn(comm, *args) on every rank: (per-rank results, per-rank traces).

    Simulated ranks raise RankFailure on a failed rank; real ones a CollectiveError. Real ranks
    pickle fn and args (module-level functions only) and take launch's keywords (`launch_kw`).
    """
    kind = RanksKind.parse(ranks)
    if kind is RanksKind.SIM:
        if launch_kw:
            raise TypeError(f"simulated ranks take no launch options (got {', '.join(sorted(launch_kw))})")
        world = SimulatedWorld(layout, timeout_s=timeout_s)
        return world.run(lambda comm: fn(comm, *args)), world.traces
    res = launch(layout, fn, *args, backend=kind.value, timeout_s=timeout_s, **launch_kw)
    return list(res.results), [list(t) for t in res.traces]
