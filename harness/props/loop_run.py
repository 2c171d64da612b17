"""A case's workload through the speculative decoding loop, once per runner, judged by the loop's properties (P5, P6).

The graph run carries the verify shadows (harness.props.verify_shadow): every TARGET_VERIFY replay is compared with
the eager verify (P3), its record checked (P1) and, on a tree engine, its tree against its chains (P5). What a run
itself finds (its ranks failed: "run"; the shadows; its graph runners never replayed, or, where the requests ask for
logprobs, a draft pass fell back to eager: P3; under mixed DP modes, a step whose collectives disagree: P7) is
reported once, with the run, whichever property asked for it first; so is what the eager and graph runs show side by
side (the requests' logprobs: P3).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from harness.cases.case import Case
from harness.golden.logprobs import compare_logprobs, logprob_arrays
from harness.props.collectives import P7, check_mixed_modes
from harness.props.logprobs import check_draft_passes_replayed
from harness.props.p3 import P3, check_loop_replayed
from harness.props.verify_shadow import VerifyShadow, install, shadow_verdicts
from harness.ranks.simulated import RankFailure
from harness.run.case_run import RUN, CaseRun
from harness.run.crash import crash_verdict
from harness.run.loop import SpecSession, case_session
from harness.verdict import Verdict, merge_verdicts

LOOP_RUNNERS = ("eager", "graph")
Judge = Callable[[SpecSession, dict], Verdict]  # one property's verdict on one loop run (its session and where)


def loop_run(case: Case, runner: str, device: str = "cpu") -> tuple[Optional[SpecSession], dict, dict[str, Verdict]]:
    """(the session, or None when its ranks failed; where; what the run itself found)."""
    where = {"case": case.name, "layout": case.layout.describe(), "runner": runner}
    shadows: list[VerifyShadow] = []  # graph: P3 / P1 / P5 on every TARGET_VERIFY replay
    found: dict[str, Verdict] = {}
    try:
        s = case_session(case, runner, hook=install(shadows) if runner == "graph" else None, device=device)
    except RankFailure as err:
        return None, where, {RUN: crash_verdict(RUN, where, err)}
    if runner == "graph":
        merge_verdicts(found, shadow_verdicts(shadows, where))
        p3 = found.setdefault(P3, Verdict(P3))
        check_loop_replayed(p3, s, where)  # a graph run that never replayed compared nothing
        if case.top_logprobs_num is not None:  # requests asked for logprobs: the draft passes still replayed their graphs
            check_draft_passes_replayed(p3, s.engines, case.scenario.spec.max_running_requests, where)
    if s.keep_traces:  # mixed DP modes: every step's collectives agree across ranks
        merge_verdicts(found, {P7: check_mixed_modes(s, where)})
    return s, where, found


def pair_findings(case: Case, sessions: dict[str, SpecSession]) -> dict[str, Verdict]:
    """What the eager and the graph run of one case show side by side: the logprobs the requests asked for (P3)."""
    if case.top_logprobs_num is None or set(sessions) != set(LOOP_RUNNERS):
        return {}
    v = Verdict(P3)
    compare_logprobs(v, f"{case.name} eager vs graph", logprob_arrays(sessions["eager"]), logprob_arrays(sessions["graph"]), "eager-vs-graph")
    return {P3: v}


def judge_loop(case: Case, judges: dict[str, Judge], out: dict[str, Verdict], runners: Sequence[str] = LOOP_RUNNERS,
               device: str = "cpu") -> dict[str, Verdict]:
    """One loop run per runner, each judged by every judge, into `out` (its verdicts made by the caller)."""
    sessions: dict[str, SpecSession] = {}
    for runner in runners:
        s, where, found = loop_run(case, runner, device)
        merge_verdicts(out, found)
        if s is not None:
            sessions[runner] = s
            for prop, judge in judges.items():
                out[prop].merge(judge(s, where))
    return merge_verdicts(out, pair_findings(case, sessions))


def shared_loop_run(run: CaseRun, runner: str) -> tuple[Optional[SpecSession], dict]:
    """The case's loop run with this runner, built once for every property of the CaseRun that reads it."""

    def build() -> tuple[Optional[SpecSession], dict]:
        run.say(f"the speculative decoding loop, {runner} runner, on simulated ranks: {run.layout_text}")
        s, where, found = loop_run(run.case, runner)
        run.record(found)
        return s, where

    return run.shared(f"loop:{runner}", build)


def judge_shared(run: CaseRun, prop: str, judge: Optional[Judge], v: Verdict) -> dict[str, Verdict]:
    """`judge` over the CaseRun's loop runs (built even when there is nothing to judge: what they find is reported)."""
    sessions: dict[str, SpecSession] = {}
    for runner in LOOP_RUNNERS:
        s, where = shared_loop_run(run, runner)
        if s is not None:
            sessions[runner] = s
            if judge is not None:
                v.merge(judge(s, where))
    run.shared("loop:eager-vs-graph", lambda: run.record(pair_findings(run.case, sessions)))
    return {prop: v}
