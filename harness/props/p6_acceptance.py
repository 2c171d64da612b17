"""P6's comparison of a loop run with the case's acceptance golden: per request and per verify round the accept
lengths, and how many rounds accepted each draft position. Shared by P6 (harness.props.p6) and the draft decode's
case check (harness.props.draft_decode); the goldens' own checks report under the same id."""
from __future__ import annotations

from harness.run.loop import SpecSession, acceptance_stats
from harness.verdict import Verdict

P6 = "P6"  # the property these checks report under (registered by harness.props.p6)


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
        got_lens, want_lens = g["accept_lens"], e["accept_lens"]
        rnd = next((i for i, (a, b) in enumerate(zip(got_lens, want_lens, strict=False)) if a != b), min(len(got_lens), len(want_lens)))
        ga = g["accept_lens"][rnd] if rnd < len(g["accept_lens"]) else "-"
        ea = e["accept_lens"][rnd] if rnd < len(e["accept_lens"]) else "-"
        v.fail("golden", "position_accepts", {**where, "request": int(rid)}, e["position_accepts"], g["position_accepts"],
               f"draft positions {changed or 'none'} changed; accept lengths first differ at verify round {rnd} (golden {ea}, got {ga})")
