"""P6 acceptance: per request and per verify round, the loop's accept lengths (and how many rounds accepted each draft
position) equal the case's acceptance golden, for the eager and the graph runner alike; where the case's requests ask
for logprobs, their tokens and logprobs equal its logprob golden too. The draft-tree goldens of the cases whose draft
runs the draft decode are P6's as well (harness.golden.draft_tree; the draft probes below)."""
from __future__ import annotations

from typing import Optional

from harness.cases.case import Case
from harness.golden.acceptance import AcceptanceGoldenError, load_acceptance_golden
from harness.golden.logprobs import check_logprob_golden
from harness.props.base import Needs, Property, Verdicts
from harness.props.draft_probes import DRAFT_PROBES
from harness.props.loop_run import Judge, judge_loop, judge_shared
from harness.props.p3 import P3
from harness.props.p6_acceptance import P6, compare_acceptance
from harness.run.case_run import RUN, CaseRun
from harness.run.loop import SpecSession
from harness.verdict import Verdict


def acceptance_judge(case: Case) -> tuple[Verdict, Optional[Judge]]:
    """P6's verdict and its judge of one loop run against the case's goldens: the acceptance golden, and the logprob
    golden where the case's requests ask for logprobs (harness.golden.logprobs). No judge when there is nothing to judge
    against (the verdict then says why: never an empty pass)."""
    v = Verdict(P6)
    golden: Optional[dict] = None
    try:
        golden = load_acceptance_golden(case)
    except AcceptanceGoldenError as e:
        v.fail("golden", "file", {"case": case.name}, "a golden for this case", "none usable", str(e))
    logprobs = case.top_logprobs_num is not None
    if golden is None and not logprobs:
        return v, None

    def judge(s: SpecSession, where: dict) -> Verdict:
        out = Verdict(P6)
        if golden is not None:
            compare_acceptance(out, golden, s, where)
        if logprobs:
            check_logprob_golden(out, case, {where["runner"]: s})
        return out

    return v, judge


def check_acceptance_case(case: Case) -> Verdict:
    """P6 alone; a run that crashed is a failure of the result, never an empty pass, and so is a graph run whose own
    checks failed (P3: its runners replayed, its verify replays matched eager): its acceptance is no evidence then."""
    v, judge = acceptance_judge(case)
    out = judge_loop(case, {P6: judge} if judge else {}, {P6: v})
    for name in (RUN, P3):
        if name in out:
            v.merge(out[name])
    return v


def check(run: CaseRun) -> Verdicts:
    v, judge = acceptance_judge(run.case)
    return judge_shared(run, P6, judge, v)


PROPERTY = Property(P6, "acceptance goldens", Needs.LOOP, check, probes=DRAFT_PROBES)
