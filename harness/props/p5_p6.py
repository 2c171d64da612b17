"""P5 lossless (committed tokens = target-only greedy) and P6 acceptance (per request, per round, against the case's golden) over the speculative decoding loop."""

from typing import Sequence

from harness import verify_props
from harness.case import Case
from harness.crash import crash_verdict
from harness.golden.acceptance import AcceptanceGoldenError, load_acceptance_golden
from harness.golden.logprobs import check_logprob_golden, compare_logprobs, logprob_arrays
from harness.props.logprobs import check_draft_passes_replayed, check_logprobs
from harness.props.mixed_modes import check_mixed_modes
from harness.ranks.simulated import RankFailure
from harness.spec_decode import (
    DEFAULT_MODEL,
    SpecSession,
    Workload,
    acceptance_stats,
    case_session,
    check_graph_replayed,
    oracle,
    run_workload,
)
from harness.verdict import Verdict, merge_verdicts
from runners.config import ModelConfig, SpecConfig
from runners.parallel.layout import ParallelLayout

# A greedy token whose top-2 target logits are closer than this may flip between two correct
# computations (fp32 sums reordered by another batch shape or TP shard: measured <= 2.4e-6 on
# logits of magnitude ~3, harness/tolerances.py). A mismatch there is a tie, noted, not a failure.
TIE_MARGIN = 1e-4


# ----------------------------------------------------------------------------------------
# P5 lossless
# ----------------------------------------------------------------------------------------


def check_lossless(session: SpecSession, where: dict) -> Verdict:
    v = Verdict("P5")
    reqs = session.requests()
    ref = oracle(session, sorted(reqs.values(), key=lambda r: r.rid))
    full = min(session.spec.num_steps, session.spec.num_tokens_per_bs - 1) + 1  # the top-1 chain's depth in the tree, + the bonus
    for rid, r in sorted(reqs.items()):
        got, exp = r.tokens[len(r.prompt):], ref[rid]
        w = {**where, "request": rid}
        v.checked += 1
        if len(got) > r.max_new_tokens:
            v.fail("lossless", "length", w, f"<= {r.max_new_tokens}", len(got), "committed past the token budget")
        bad = next((i for i, (a, b) in enumerate(zip(got, exp.tokens, strict=False)) if a != b), None)
        if bad is not None:
            if exp.margins[bad] < TIE_MARGIN:
                v.notes.append(f"P5 {w}: output token {bad} is a near-tie of the target (margin {exp.margins[bad]:.2g}); not compared further")
            else:
                v.fail("lossless", "tokens", {**w, "position": bad}, exp.tokens[bad : bad + 4], got[bad : bad + 4],
                       f"output token {bad} differs from target-only greedy (margin {exp.margins[bad]:.3g})")
        if session.proposer == "target":
            for k, a in enumerate(r.accept_lens):
                v.checked += 1
                if a != full:
                    v.fail("accept-all", "accept_len", {**w, "round": k}, full, a, "a draft that equals the target must accept its whole chain")
                    break
    if any(r.return_logprob for r in reqs.values()):  # the committed tokens' logprobs are the oracle's too
        v.merge(check_logprobs(reqs, ref, session.model.dtype, where))
    return v


# ----------------------------------------------------------------------------------------
# P6 acceptance goldens
# ----------------------------------------------------------------------------------------


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


def check_spec_case(case: Case, runners: Sequence[str] = ("eager", "graph"), props: Sequence[str] = ("P5", "P6"),
                    device: str = "cpu") -> dict[str, Verdict]:
    """P5 and P6 on one case's workload, one run per runner; the graph run also gives the
    TARGET_VERIFY runner's P3 and P1 (harness.verify_props)."""
    out = {p: Verdict(p) for p in props}
    golden = None
    if "P6" in props:
        try:
            golden = load_acceptance_golden(case)
        except AcceptanceGoldenError as e:
            out["P6"].fail("golden", "file", {"case": case.name}, "a golden for this case", "none usable", str(e))
    logprobs_of: dict[str, dict] = {}  # per runner, the logprobs the case's requests asked for (P3: eager vs graph)
    for runner in runners:
        where = {"case": case.name, "layout": case.layout.describe(), "runner": runner}
        shadows: list[verify_props.VerifyShadow] = []  # graph: P3 / P1 on every TARGET_VERIFY replay
        try:
            s = case_session(case, runner, hook=verify_props.install(shadows) if runner == "graph" else None, device=device)
        except RankFailure as err:
            out["run"] = out.get("run", Verdict("run")).merge(crash_verdict("run", where, err))
            continue
        if runner == "graph":
            merge_verdicts(out, verify_props.shadow_verdicts(shadows, where))
            check_graph_replayed(out.setdefault("P3", Verdict("P3")), s, where)  # a graph run that never replayed compared nothing
        if "P5" in props:
            out["P5"].merge(check_lossless(s, where))
        if golden is not None:
            compare_acceptance(out["P6"], golden, s, where)
        if s.keep_traces:  # mixed DP modes: every step's collectives agree across ranks (P7)
            out.setdefault("P7", Verdict("P7")).merge(check_mixed_modes(s, where))
        if case.top_logprobs_num is not None:  # requests asked for logprobs: the logprob golden, the draft graphs' replays
            logprobs_of[runner] = logprob_arrays(s)
            if "P6" in props:
                check_logprob_golden(out["P6"], case, {runner: s})
            replayed = check_draft_passes_replayed(s.engines, case.scenario.spec.max_running_requests, where) if runner == "graph" else None
            if replayed is not None:
                out.setdefault("P3", Verdict("P3")).merge(replayed)
    if len(logprobs_of) == 2:
        compare_logprobs(out.setdefault("P3", Verdict("P3")), f"{case.name} eager vs graph", logprobs_of["eager"], logprobs_of["graph"], "eager-vs-graph")
    return out


def check_acceptance_case(case: Case) -> Verdict:
    """P6 alone; a run that crashed is a failure of the result, never an empty pass, and so is a graph run whose own
    checks failed (P3: its runners replayed, its verify replays matched eager): its acceptance is no evidence then."""
    out = check_spec_case(case, props=("P6",))
    v = out["P6"]
    for name in ("run", "P3"):
        if name in out:
            v.merge(out[name])
    return v


def check_agreeing_draft(layout: ParallelLayout, spec: SpecConfig, wl: Workload, model: ModelConfig = DEFAULT_MODEL) -> dict[str, Verdict]:
    """P5's positive control: the target's own weights as the draft accept every token."""
    where = {"layout": layout.describe(), "proposer": "target", "topk": spec.topk}
    try:
        s = run_workload(SpecSession(layout, spec, model, proposer="target"), wl)
    except RankFailure as err:
        return {"run": crash_verdict("run", where, err)}
    return {"P5": check_lossless(s, where)}

