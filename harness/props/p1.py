"""P1 metadata invariants: every graph runner's baked and filled metadata (the fast path, harness.props.p1_metadata,
one record's rules in harness.props.p1_records) and what really reached lm_head in the case run (I2, I7 on the eager
path, below)."""
from __future__ import annotations

from typing import Sequence

from harness.props.base import Invariant, Needs, Probe, Property, Verdicts
from harness.props.p1_metadata import check_metadata
from harness.props.p1_records import P1, check_replay_rows
from harness.run.case_run import CaseRun
from harness.run.layouts import all_layouts
from harness.run.rig import RankRun
from harness.run.scenario import Scenario
from harness.verdict import Verdict
from runners.config import DraftExtendShape, SpecConfig
from runners.parallel.layout import ParallelLayout


def check_run_metadata(sc: Scenario, runs: Sequence[RankRun]) -> Verdict:
    """I2 on graph replays: rows fed to lm_head == for_logprob[r] == logits rows produced;
    Σ over DP groups of rows fed == Σ of logits rows; and the same for the eager path."""
    v = Verdict(P1)
    layout, T = sc.layout, sc.spec.num_tokens_per_bs
    for run in runs:
        d = layout.attn_dp_rank(run.rank)
        for it, recs in enumerate(run.records):
            for rec in recs:
                check_replay_rows(v, layout, rec, run.rank, it, expected_rows=rec.bs * T)
        for it, steps in enumerate(run.eager):
            for step, res in enumerate(steps):
                w = {"layout": layout.describe(), "runner": "eager", "rank": run.rank, "iteration": it, "step": step}
                n = eager_logit_rows(sc, it, d, res.out.logits.shape[0])
                real = eager_logit_rows(sc, it, d, len(run.rids[it]) * T)
                what = "accepted tokens" if sc.spec.draft_extend_shape is DraftExtendShape.RAGGED else "tokens"
                v.expect_agree("I2", None, w, {"rows fed to lm_head (eager)": int(res.out.rows_fed), "logits rows (eager)": n}, real,
                               f"the {real} {what} of this rank's requests")
                lp = res.host["global_num_tokens_for_logprob_cpu"]
                if lp is not None:
                    own = lp[d if layout.require_mlp_tp_gather else 0]
                    v.expect_equal("I7", "global_num_tokens_for_logprob (eager)", w, n, own, "our eager path counts tokens, like the graph")
    return v


def eager_logit_rows(sc: Scenario, it: int, dp_rank: int, logits_rows: int) -> int:
    """The rows an eager pass gives lm_head: every row of its logits (T per request), or under the ragged shape the
    accepted tokens alone (its logits come back T rows per request, the rejected ones zero: runners.ragged_draft_extend)."""
    if sc.spec.draft_extend_shape is not DraftExtendShape.RAGGED:
        return logits_rows
    return sum(r.accept_len for r in sc.iterations[it].per_dp[dp_rank])


def check(run: CaseRun) -> Verdicts:
    """The metadata path over the case's layout and schedule, then the rows the case run fed lm_head (when it ran)."""
    case, sc = run.case, run.sc
    v = check_metadata(sc.layout, sc.spec, case.schedule, sc.model, sc.seed)
    runs = run.runs_or_none()
    if runs is not None:
        v.merge(check_run_metadata(sc, runs))
    return {P1: v}


# ---- probes ----

# A shrink schedule with uneven DP groups: exercises every bucket boundary and stale lanes.
GRID_SCHEDULE = ((6, 3, 5, 1, 2, 4, 7, 8), (2, 1, 1, 0, 1, 2, 1, 3), (1, 2, 1, 1, 1, 1, 1, 1))


GRID_SPECS = (
    ("chains", SpecConfig(num_steps=3, capture_bs=(1, 2, 4, 8), max_running_requests=8)),
    # trees of 3 verify tokens: the fewest that make a tree other than the chain (a stale padded tree mask then shows)
    ("trees", SpecConfig(num_steps=1, topk=2, num_draft_tokens=3, capture_bs=(1, 2, 4, 8, 16))),
)


def grid_part(spec: SpecConfig, tp_size: int) -> Verdicts:
    """P1 on every reachable layout of one TP size (every branch), over the grid's schedule."""
    v = Verdict(P1)
    for layout in (lay for lay in all_layouts() if lay.tp_size == tp_size):
        dp = layout.attn_dp_size
        schedule = [row[:dp] if dp > 1 else row[:1] for row in GRID_SCHEDULE]
        schedule = [s if sum(s) else (1,) + tuple(s[1:]) for s in schedule]
        v.merge(check_metadata(layout, spec, schedule))
    return {P1: v}


# P1 on every reachable layout (TP 1/2/4/8, every branch) with chains and trees: a part per spec and TP size, so a
# mutant names the part that shows it (TP1 has an attn-TP-gather branch: layouts with a2a or dense TP1)
GRID_TP_SIZES = (1, 2, 4, 8)  # all_layouts()' (tests/test_mutant_run.py holds them equal)
METADATA_GRID = Probe.of("metadata-grid", tuple(
    Probe(f"metadata-grid:{name}-tp{tp}", lambda spec=spec, tp=tp: grid_part(spec, tp)) for name, spec in GRID_SPECS for tp in GRID_TP_SIZES
))


# P1 in one run, for the mutants that any layout shows: every graph runner (trees of 3 tokens, a 2-step draft) on one
# gathered layout with DP groups, over the grid's schedule (a batch shrinks within a bucket). The grid is for the
# mutants that only other layouts show (buckets on attn-TP, the attn-TP-gather branch).
FILL_METADATA_SPEC = SpecConfig(num_steps=2, topk=2, num_draft_tokens=3, capture_bs=(1, 2, 4, 8), max_running_requests=8)
FILL_METADATA_LAYOUT = ParallelLayout(tp_size=2, dp_size=2, enable_dp_attention=True)


def probe_metadata_dp() -> Verdicts:
    return {P1: check_metadata(FILL_METADATA_LAYOUT, FILL_METADATA_SPEC, [row[:2] for row in GRID_SCHEDULE])}


PROPERTY = Property(
    P1, "metadata invariants", Needs.METADATA | Needs.CASE_RUN, check,
    probes=(METADATA_GRID, Probe("metadata-dp", probe_metadata_dp)),
    invariants=(
        Invariant("I1", "capture = replay: every field the replay writes for a bucket (the gathered counts, every other field of the batch "
                             "and its spec info) agrees with the value baked at capture for it"),
        Invariant("I2", "row count: for_logprob[r] equals the rows fed to lm_head on rank r"),
        Invariant("I3", "branch parity: the MLP-TP and attn-TP branches count the same rows per request for the same batch"),
        Invariant("I4", "the gathered buffer: Σ for_logprob = its rows = global_dp_buffer_len"),
        Invariant("I5", "for_logprob <= global_num_tokens per rank, equal for unpruned DRAFT_EXTEND_V2"),
        Invariant("I6", "the single-layer and multi-layer runners agree on for_logprob for the same batches"),
        Invariant("I7", "eager and graph agree: the eager path counts the rows it feeds lm_head, as the graph does"),
    ),
)
