"""P1, run path: what actually reached lm_head (I2, I7 on the eager path), and the graphs really replayed."""
from __future__ import annotations

from typing import Sequence

from harness.execute import RankRun
from harness.props.p1_records import check_replay_rows
from harness.scenario import Scenario
from harness.verdict import Verdict
from runners.config import DraftExtendGraph, DraftExtendShape


def check_run_metadata(sc: Scenario, runs: Sequence[RankRun]) -> Verdict:
    """I2 on graph replays: rows fed to lm_head == for_logprob[r] == logits rows produced;
    Σ over DP groups of rows fed == Σ of logits rows; and the same for the eager path."""
    v = Verdict("P1")
    layout, T = sc.layout, sc.spec.num_tokens_per_bs
    for run in runs:
        d = layout.attn_dp_rank(run.rank)
        for it, recs in enumerate(run.records):
            for rec in recs:
                check_replay_rows(v, layout, rec, run.rank, it, expected_rows=rec.bs * T)
        for it, steps in enumerate(run.eager):
            for step, res in enumerate(steps):
                w = {"layout": layout.describe(), "runner": "eager", "rank": run.rank, "iteration": it, "step": step}
                n = eager_logit_rows(sc, it, d, res.tensors["logits"].shape[0])
                v.expect_equal("I2", "rows fed to lm_head (eager)", w, n, int(res.tensors["rows_fed"]))
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


def check_graph_replayed(sc: Scenario, runs: Sequence[RankRun], expect_fallbacks: int = 0) -> Verdict:
    v = Verdict("P3")
    for run in runs:
        if run.stats is None:
            continue
        w = {"layout": sc.layout.describe(), "rank": run.rank}
        one_graph = sc.spec.draft_extend_graph is DraftExtendGraph.ONE_GRAPH  # a record per step, one replay per iteration
        replays = sum(min(len(r), 1) if one_graph else len(r) for r in run.records)
        v.expect_equal("replayed", "graph replays", w, replays, run.stats.replays,
                       "every iteration replayed its one graph" if one_graph else "every step of every iteration replayed a graph")
        v.expect_equal("replayed", "eager fallbacks", w, expect_fallbacks, run.stats.eager_fallbacks)
        v.expect_equal("replayed", "replays > 0", w, True, run.stats.replays > 0)
    return v

