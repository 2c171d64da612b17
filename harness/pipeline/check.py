"""The case pipeline: a case's runs (one CaseRun) judged by every selected property of the registry, into a report.

`harness check`, `harness replay`, the pytest plugin and the API (`harness.check_case`) all run this one path, so
they judge a case alike (its `[tolerances]` overrides included) and report the same verdicts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from harness.cases.case import Case
from harness.props import registry
from harness.props.base import Needs
from harness.ranks import RanksKind
from harness.run.case_run import CaseRun, RunCrashed
from harness.run.rig import RankRun, RunnerChoice
from harness.verdict import Verdict, merge_verdicts

parse_props = registry.parse_props


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
        for name in registry.report_order():
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


def require_ranks(props: Sequence[str], ranks: RanksKind | str) -> None:
    """The loop's properties drive it on simulated ranks; asking for them on real ranks is an error, not a silent skip."""
    loop = [p for p in props if Needs.LOOP in registry.get(p).needs]
    if loop and RanksKind.parse(ranks) is not RanksKind.SIM:
        raise ValueError(f"{','.join(loop)} run on simulated ranks only; use --ranks sim or --props {','.join(registry.default_ids())}")


def judge(run: CaseRun, props: Sequence[str]) -> CaseReport:
    """Every selected property over one CaseRun, in registry order; what the runs found is reported once, with them."""
    t0 = time.perf_counter()
    sc = run.sc
    rep = CaseReport(run.case.name, sc.layout.describe(), sc.layout.branch.value)
    wanted = set(props)
    for prop in registry.properties():
        if prop.id not in wanted:
            continue
        if prop.check is None:
            raise ValueError(f"{prop.id} is not judged per case: it runs under {prop.runs_under}")
        why = prop.unmet(run)
        if why is not None:
            rep.skipped[prop.id] = why
            continue
        run.say(f"{prop.id} {prop.title}: {run.layout_text}")
        try:
            merge_verdicts(rep.verdicts, prop.check(run))
        except RunCrashed:
            continue  # the case run failed: run.found says how, and this property can't be judged
    merge_verdicts(rep.verdicts, run.found)
    rep.runs, rep.oracle = run.built_runs, run.built_oracle
    rep.seconds = time.perf_counter() - t0
    return rep


def check_case(case: Case, props: Optional[Sequence[str]] = None, on_progress: Optional[Callable[[str], None]] = None,
               ranks: RanksKind | str = RanksKind.SIM, runner: RunnerChoice = "both") -> CaseReport:
    """Run `props` (default: those of one run of the case's runners) on one case and report each property's verdict.

    The properties of one run share one run of the case on `ranks` ("sim", "gloo" or "nccl") and a TP1 eager run as
    the cross-layout oracle; the loop's properties drive the case's workload through the speculative decoding loop,
    on simulated ranks only. A run that crashes or desyncs is reported under "run", since nothing can be judged on
    it; running out of memory raises OutOfMemory rather than failing a property.
    """
    props = registry.default_ids() if props is None else tuple(props)
    unknown = [p for p in props if p not in registry.case_ids()]
    if unknown:
        raise ValueError(f"not case properties: {', '.join(unknown)}; a case check runs {', '.join(registry.case_ids())} "
                         f"(not per case: {registry.elsewhere_note()})")
    require_ranks(props, ranks)
    return judge(CaseRun(case, ranks, runner, on_progress), props)
