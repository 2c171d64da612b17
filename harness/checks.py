"""Run every property over one case: the engine behind `harness check` and `harness mutants`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from harness.case import Case
from harness.execute import RankRun, run_rank
from harness.properties import check_cross_layout, check_eager_vs_graph, check_metadata, check_run_metadata
from harness.ranks.simulated import RankFailure, SimulatedWorld
from harness.scenario import Scenario
from harness.verdict import Verdict

PROPERTY_ORDER = ("P1", "P3", "P4")


@dataclass
class CaseReport:
    case: str
    layout: str
    branch: str
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    seconds: float = 0.0
    runs: Optional[list[RankRun]] = None
    oracle: Optional[list[RankRun]] = None

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts.values())

    def first_failure(self) -> Optional[tuple[str, str]]:
        for name in PROPERTY_ORDER:
            v = self.verdicts.get(name)
            if v is not None and not v.ok:
                return name, v.first()
        return None

    def to_json(self) -> dict:
        return {
            "case": self.case,
            "layout": self.layout,
            "branch": self.branch,
            "ok": self.ok,
            "seconds": round(self.seconds, 3),
            "properties": {k: v.to_json() for k, v in self.verdicts.items()},
        }


RANKS = ("sim", "gloo", "nccl")


def run_spmd(sc: Scenario, runner: str = "both", single_layer: bool = False, timeout_s: float = 60.0, ranks: str = "sim") -> list[RankRun]:
    """The same SPMD function on simulated ranks (threads) or real ones (a process per rank)."""
    if ranks == "sim":
        return SimulatedWorld(sc.layout, timeout_s=timeout_s).run(lambda comm: run_rank(comm, sc, runner=runner, single_layer=single_layer))
    if ranks not in RANKS:
        raise ValueError(f"ranks must be one of {RANKS}, got {ranks!r}")
    from harness.ranks.launcher import launch

    device = "cuda" if ranks == "nccl" else "cpu"
    res = launch(sc.layout, run_rank, sc, runner, single_layer, "auto", device, backend=ranks, timeout_s=timeout_s)
    return list(res.results)


def _crash_verdict(prop: str, sc: Scenario, err: RankFailure) -> Verdict:
    """A rank failing is a finding (a collective mismatch is a detected desync); `got` names the
    root exception type so the mutant report can tell a timeout (never a kill) from a crash."""
    v = Verdict(prop)
    v.fail("run", "ranks", {"layout": sc.layout.describe()}, "every rank completes", type(err.root_exception).__name__, str(err).splitlines()[0])
    return v


def check_case(
    case: Case, props: tuple[str, ...] = PROPERTY_ORDER, on_progress: Optional[Callable[[str], None]] = None, ranks: str = "sim"
) -> CaseReport:
    t0 = time.perf_counter()
    sc = case.scenario
    rep = CaseReport(case.name, sc.layout.describe(), sc.layout.branch.value)
    say = on_progress or (lambda _msg: None)
    if "P1" in props:
        say("P1 metadata")
        rep.verdicts["P1"] = check_metadata(sc.layout, sc.spec, case.schedule, sc.model, sc.seed)
    if any(p in props for p in ("P1", "P3", "P4")):
        say(f"eager + graph on {ranks} ranks")
        try:
            rep.runs = run_spmd(sc, ranks=ranks)
        except RankFailure as err:
            for p in props:
                rep.verdicts.setdefault(p, Verdict(p)).merge(_crash_verdict(p, sc, err))
            rep.seconds = time.perf_counter() - t0
            return rep
        if "P1" in props:
            rep.verdicts["P1"].merge(check_run_metadata(sc, rep.runs))
        if "P3" in props:
            rep.verdicts["P3"] = check_eager_vs_graph(sc, rep.runs)
        if "P4" in props:
            say("TP1 oracle")
            rep.oracle = run_spmd(sc.as_tp1(), runner="eager")  # the oracle always runs in-process
            v = check_cross_layout(sc, rep.runs, rep.oracle, "eager")
            rep.verdicts["P4"] = v.merge(check_cross_layout(sc, rep.runs, rep.oracle, "graph"))
    rep.seconds = time.perf_counter() - t0
    return rep
