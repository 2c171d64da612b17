"""P5 lossless: the loop's committed tokens equal target-only greedy decoding of the same requests; a draft that equals
the target accepts its whole chain (the positive control)."""
from __future__ import annotations

import functools
from typing import Sequence

from harness.cases.case import Case, load_case
from harness.props.base import Needs, Probe, Property, Verdicts
from harness.props.collectives import P7
from harness.props.logprobs import check_logprobs
from harness.props.loop_run import LOOP_RUNNERS, Judge, judge_loop, judge_shared
from harness.props.p6 import P6, acceptance_judge
from harness.ranks.simulated import RankFailure
from harness.run.case_run import RUN, CaseRun
from harness.run.crash import crash_verdict
from harness.run.loop import DEFAULT_MODEL, SpecSession, Workload, oracle, run_workload
from harness.verdict import Failure, Verdict, merge_verdicts
from runners.config import ModelConfig, SpecConfig
from runners.parallel.layout import ParallelLayout

P5 = "P5"

# A greedy token whose top-2 target logits are closer than this may flip between two correct
# computations (fp32 sums reordered by another batch shape or TP shard: measured <= 2.4e-6 on
# logits of magnitude ~3, harness/props/tolerances.py). A mismatch there is a tie, noted, not a failure.
TIE_MARGIN = 1e-4


def check_lossless(session: SpecSession, where: dict) -> Verdict:
    v = Verdict(P5)
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
        check_logprobs(v, reqs, ref, session.model.dtype, where)
    return v


def check_spec_case(case: Case, runners: Sequence[str] = LOOP_RUNNERS, props: Sequence[str] = (P5, P6),
                    device: str = "cpu") -> dict[str, Verdict]:
    """P5 and P6 on one case's workload, one run per runner; the graph run also gives the
    TARGET_VERIFY runner's P3 and P1 (harness.props.verify_shadow)."""
    out: dict[str, Verdict] = {}
    judges: dict[str, Judge] = {}
    for prop in props:
        if prop == P5:
            out[P5], judges[P5] = Verdict(P5), check_lossless
        elif prop == P6:
            out[P6], judge = acceptance_judge(case)
            if judge is not None:
                judges[P6] = judge
        else:
            raise ValueError(f"check_spec_case judges {P5} and {P6}, not {prop}")
    return judge_loop(case, judges, out, runners, device)


def check_agreeing_draft(layout: ParallelLayout, spec: SpecConfig, wl: Workload, model: ModelConfig = DEFAULT_MODEL) -> dict[str, Verdict]:
    """P5's positive control: the target's own weights as the draft accept every token."""
    where = {"layout": layout.describe(), "proposer": "target", "topk": spec.topk}
    try:
        s = run_workload(SpecSession(layout, spec, model, proposer="target"), wl)
    except RankFailure as err:
        return {RUN: crash_verdict(RUN, where, err)}
    return {P5: check_lossless(s, where)}


def check(run: CaseRun) -> Verdicts:
    return judge_shared(run, P5, check_lossless, Verdict(P5))


# ---- the probe (a few seconds on 2 cores) ----

PROBE_SPEC_CASES = ("tp1_neither", "tp4_attn_tp_gather", "tp4_neither_topk2", "tp2_page4_shrink", "tp2_page4_tree")
# The eager runner only: under DP attention only an eager pass is MLP-sync padded (runners.mlp_sync),
# a verify batch in whole trees; a graph replay pads to its bucket instead. Uneven groups, one idle at the end.
PROBE_DP_EAGER_CASES = ("tp2_dp2_mlp_tp_gather",)
AGREE_RUNS = (  # P5's positive control: plain TP (tree with topk 2) and an MLP-TP-gather DP layout
    (ParallelLayout(tp_size=2), SpecConfig(num_steps=2, topk=2, capture_bs=(1, 2, 4, 8), max_running_requests=8), Workload(((3,), (5,), (2,)), 2)),
    (ParallelLayout(tp_size=2, dp_size=2, enable_dp_attention=True), SpecConfig(num_steps=3, topk=1, capture_bs=(1, 2, 4, 8), max_running_requests=8),
     Workload(((2, 1), (3, 0), (1, 2)), 2)),
)


# P5 and P6 (graph runner) over the probe cases, (eager runner) over the DP ones; the agreeing draft (P5) on two layouts:
# a part each
SPEC_CASES_PROBE = Probe.of("spec-cases", (
    *(Probe.guarded(f"spec-cases:{name}", lambda name=name: check_spec_case(load_case(name), runners=("graph",))) for name in PROBE_SPEC_CASES),
    *(Probe.guarded(f"spec-cases:{name}-eager", lambda name=name: check_spec_case(load_case(name), runners=("eager",))) for name in PROBE_DP_EAGER_CASES),
    Probe.guarded("spec-cases:agreeing-draft", lambda: functools.reduce(merge_verdicts, (check_agreeing_draft(*run) for run in AGREE_RUNS), {})),
))


# ---- the probes of the loop's features a case enables: the feature's shipped case through the loop with the graph
# runner (its decode steps replay graphs), a few seconds each on 2 cores ----

LOGPROB_CASE = "tp2_dp2_logprobs"
OVERLAP_CASE = "tp2_dp2_overlap"
# the torch_planned backend's cases (flashinfer's host plan in torch ops): multi-layer (steps planned once) and the draft decode
PLANNED_CASES = ("tp2_planned_shrink", "tp1_planned_single_layer")


def _planned_loop() -> Verdicts:
    """P5 (and the verify runner's P1/P3) through the loop on the torch_planned cases: prompt prefills eager (their own
    plans), every runner graphed (a plan per replay)."""
    out: Verdicts = {}
    for name in PLANNED_CASES:
        merge_verdicts(out, check_spec_case(load_case(name), runners=("graph",), props=(P5,)))
    return out


def feature_case(name: str) -> Verdicts:
    """P3 (graphs replayed; logprobs: the draft graphs replayed every batch), P5 (tokens and logprobs against the
    oracle), P6 (the acceptance and logprob goldens), P7 (mixed modes: every step's collectives). A run whose ranks did
    not finish (a collective desync between DP groups, a rank that raised) is a P7 failure here, as the idle-rank probe
    reports one: P7 is the property that every rank issues the same collectives and completes."""
    out = check_spec_case(load_case(name), runners=("graph",))
    run = out.pop(RUN, None)
    if run is not None:
        p7 = out.setdefault(P7, Verdict(P7))
        p7.checked += run.checked
        p7.failures += [Failure(P7, RUN, f.field, f.where, f.expected, f.got, f.detail) for f in run.failures]
    return out


PROPERTY = Property(
    P5, "lossless speculative decoding", Needs.LOOP, check,
    probes=(
        SPEC_CASES_PROBE,
        # logprobs through the loop: the oracle's logprobs and top-k (P5), the logprob golden (P6), the draft passes' graphs (P3)
        Probe.guarded("logprob-case", lambda: feature_case(LOGPROB_CASE)),
        # the overlap scheduler: the tokens committed for each launch and the KV it reserves and frees (P5, P6)
        Probe.guarded("overlap-case", lambda: feature_case(OVERLAP_CASE)),
        Probe.guarded("planned-loop", _planned_loop),
    ),
)
