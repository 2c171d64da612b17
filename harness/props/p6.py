"""P6 acceptance: per request and per verify round, the loop's accept lengths (and how many rounds accepted each draft
position) equal the case's acceptance golden, for the eager and the graph runner alike."""
from __future__ import annotations

from typing import Optional

from harness.case import Case
from harness.golden.acceptance import AcceptanceGoldenError, load_acceptance_golden
from harness.props.base import Needs, Property, Verdicts
from harness.props.loop_run import Judge, judge_loop, judge_shared
from harness.props.p3 import P3
from harness.run.case_run import RUN, CaseRun
from harness.run.loop import SpecSession, acceptance_stats
from harness.verdict import Verdict

P6 = "P6"


def compare_acceptance(v: Verdict, golden: dict, session: SpecSession, where: dict) -> None:
    got, exp = acceptance_stats(session)["requests"], golden["requests"]
    S = session.spec.num_steps
    v.checked += 1
    if set(got) != set(exp):
        v.fail("golden", "requests", where, sorted(exp, key=int), sorted(got, key=int),
               "other requests ran (the workload replaces the requests that finish, so acceptance changed who finished when)")
    for rid in sorted(set(got) & set(exp), key=int):
        g, e = got[rid], exp[rid]
        v.checked += 1
        if g["accept_lens"] == e["accept_lens"] and g["position_accepts"] == e["position_accepts"]:
            continue
        changed = [k + 1 for k in range(S) if g["position_accepts"][k] != e["position_accepts"][k]]
        rnd = next((i for i, (a, b) in enumerate(zip(g["accept_lens"], e["accept_lens"], strict=False)) if a != b), min(len(g["accept_lens"]), len(e["accept_lens"])))
        ga = g["accept_lens"][rnd] if rnd < len(g["accept_lens"]) else "-"
        ea = e["accept_lens"][rnd] if rnd < len(e["accept_lens"]) else "-"
        v.fail("golden", "position_accepts", {**where, "request": int(rid)}, e["position_accepts"], g["position_accepts"],
               f"draft positions {changed or 'none'} changed; accept lengths first differ at verify round {rnd} (golden {ea}, got {ga})")


def acceptance_judge(case: Case) -> tuple[Verdict, Optional[Judge]]:
    """P6's verdict and its judge of one loop run against the case's golden; no judge when there is no usable golden
    (the verdict then says so: never an empty pass)."""
    v = Verdict(P6)
    try:
        golden = load_acceptance_golden(case)
    except AcceptanceGoldenError as e:
        v.fail("golden", "file", {"case": case.name}, "a golden for this case", "none usable", str(e))
        return v, None

    def judge(s: SpecSession, where: dict) -> Verdict:
        out = Verdict(P6)
        compare_acceptance(out, golden, s, where)
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


PROPERTY = Property(P6, "acceptance goldens", Needs.LOOP, check)
