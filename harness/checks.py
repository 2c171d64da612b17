"""Run every property over one case: the engine behind `harness check` and `harness mutants`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from harness.case import Case
from harness.crash import crash_detail, crash_name, crash_verdict
from harness.errors import OutOfMemory, is_oom
from harness.execute import RankRun, run_rank
from harness.props.names import CASE_PROPS, FAST_PROPS, SPEC_PROPS
from harness.props.p1_metadata import check_metadata
from harness.props.p1_run import check_run_metadata
from harness.props.p2 import check_padded_lanes
from harness.props.p3 import check_eager_vs_graph
from harness.props.p4 import check_cross_layout
from harness.props.p5_p6 import check_spec_case
from harness.ranks import RanksKind
from harness.ranks import run as ranks_run
from harness.ranks.simulated import RankFailure
from harness.ranks.trace import CollectiveError
from harness.scenario import Scenario
from harness.spec_decode import spec_skip_reason
from harness.verdict import Verdict, merge_verdicts

REPORT_ORDER = ("run", "P1", "P2", "P3", "P4", "P5", "P6")  # how a case reports: "run" (every rank finished, collectives consistent) first


@dataclass
class CaseReport:
    """What `check_case` found on one case: a Verdict per property that ran, and for each property that could not
    run on this case the reason (a skip, never a pass). `ok` holds only when every verdict held; `first_failure()`
    is what a one-line report shows.
    """
    case: str
    layout: str
    branch: str
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # property -> why it could not run on this case (never a pass)
    seconds: float = 0.0
    runs: Optional[list[RankRun]] = None
    oracle: Optional[list[RankRun]] = None

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts.values())

    @property
    def status(self) -> str:
        """pass, fail, or skip: every requested property was skipped, so nothing was checked (never a pass)."""
        return "fail" if not self.ok else "pass" if self.verdicts else "skip"

    def first_failure(self) -> Optional[tuple[str, str]]:
        for name in REPORT_ORDER:
            v = self.verdicts.get(name)
            if v is not None and not v.ok:
                return name, v.first()
        return None

    def to_json(self) -> dict:
        return {
            "case": self.case,
            "layout": self.layout,
            "branch": self.branch,
            "ok": self.status == "pass",
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "properties": {k: v.to_json() for k, v in self.verdicts.items()},
            "skipped": dict(self.skipped),
        }


def run_spmd(sc: Scenario, runner: str = "both", single_layer: bool = False, timeout_s: float = 60.0,
             ranks: RanksKind | str = RanksKind.SIM) -> list[RankRun]:
    """Every rank's run of the scenario (run_rank) on the chosen ranks; the traces stay with harness.ranks.run."""
    kind = RanksKind.parse(ranks)
    return ranks_run(sc.layout, run_rank, sc, runner, single_layer, "auto", kind.device, ranks=kind, timeout_s=timeout_s)[0]




def parse_props(text: str) -> tuple[str, ...]:
    """`all`, or a comma list of CASE_PROPS; anything else names what is accepted."""
    if text == "all":
        return CASE_PROPS
    props = tuple(p.strip().upper() for p in text.split(",") if p.strip())
    bad = [p for p in props if p not in CASE_PROPS]
    if bad or not props:
        raise ValueError(f"--props {text!r}: expected 'all' or a comma list of {', '.join(CASE_PROPS)}; "
                         f"{'unknown: ' + ', '.join(bad) if bad else 'none given'} (P7, P8: pytest / harness mutants)")
    return props


def require_sim_for_spec_props(props: Sequence[str], ranks: str) -> None:
    """P2/P5/P6 drive the loop on simulated ranks; asking for them on real ranks is an error, not a silent skip."""
    spec = [p for p in props if p in SPEC_PROPS]
    if spec and ranks != "sim":
        raise ValueError(f"{','.join(spec)} run on simulated ranks only; use --ranks sim or --props {','.join(FAST_PROPS)}")


def check_case(
    case: Case, props: tuple[str, ...] = FAST_PROPS, on_progress: Optional[Callable[[str], None]] = None, ranks: str = "sim"
) -> CaseReport:
    """Run `props` on one case and report each property's verdict.

    P1, P3 and P4 share one run of the case on `ranks` ("sim", "gloo" or "nccl"), plus a TP1 eager run as P4's
    oracle; P2, P5 and P6 drive the case's workload through the speculative decoding loop, on simulated ranks only.
    A run that crashes or desyncs is reported under "run", since P3 and P4 cannot be judged on it; running out of
    memory raises OutOfMemory rather than failing a property.
    """
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
        except (RankFailure, CollectiveError) as err:  # simulated or real ranks
            if is_oom(getattr(err, "root_exception", err), crash_name(err)):  # the machine ran short: no property was judged
                raise OutOfMemory(f"{case.name}: a rank ran out of memory ({crash_detail(err)})") from err
            rep.verdicts["run"] = crash_verdict("run", {"layout": sc.layout.describe()}, err)  # P3/P4 can't be judged on a run that didn't finish
            rep.seconds = time.perf_counter() - t0
            return rep
        if "P1" in props:
            rep.verdicts["P1"].merge(check_run_metadata(sc, rep.runs))
        if "P3" in props:
            rep.verdicts["P3"] = check_eager_vs_graph(sc, rep.runs, tol_override=case.tol("eager_vs_graph"))
        if "P4" in props:
            say("TP1 oracle")
            rep.oracle = run_spmd(sc.as_tp1(), runner="eager")  # the oracle always runs in-process
            tol = case.tol("cross_layout")  # a case's [tolerances] table overrides harness/tolerances.py
            v = check_cross_layout(sc, rep.runs, rep.oracle, "eager", tol_override=tol)
            rep.verdicts["P4"] = v.merge(check_cross_layout(sc, rep.runs, rep.oracle, "graph", tol_override=tol))
    spec_props = [p for p in props if p in SPEC_PROPS]
    if spec_props:
        require_sim_for_spec_props(spec_props, ranks)
        _check_spec_props(case, spec_props, rep, say)
    rep.seconds = time.perf_counter() - t0
    return rep


def _check_spec_props(case: Case, spec_props: Sequence[str], rep: CaseReport, say: Callable[[str], None]) -> None:
    why = spec_skip_reason(case)
    if why is not None:
        rep.skipped.update({p: why for p in spec_props})
        return
    if "P2" in spec_props:
        say("P2 padded lanes")
        merge_verdicts(rep.verdicts, check_padded_lanes(case))
    loop = tuple(p for p in ("P5", "P6") if p in spec_props)
    if loop:
        say("P5/P6 speculative decoding loop")
        merge_verdicts(rep.verdicts, check_spec_case(case, props=loop))

