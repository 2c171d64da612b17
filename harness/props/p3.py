"""P3 eager vs graph: per draft step, real rows only, the same run's eager and graph runners agree; and the graphs
really replayed (a graph run that fell back to eager would compare eager with eager)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from harness.props.base import Needs, Property, Verdicts
from harness.props.outputs import compare_outputs
from harness.props.tolerances import Tol, eager_vs_graph
from harness.run.case_run import CaseRun
from harness.run.loop import SpecSession
from harness.run.rig import RankRun
from harness.run.scenario import Scenario
from harness.verdict import Verdict
from runners.config import DraftExtendGraph
from runners.draft_decode import EagleProposer

P3 = "P3"
P2 = "P2"  # the property that names a padded lane (harness.props.p2)


def padded_lane_hint(case_name: str, raw_bs: Any, bs: Any) -> str:
    """Where a graph-only difference sits on a padded bucket, the padded lanes are the first suspect: P2 names the lane."""
    if isinstance(bs, int) and isinstance(raw_bs, int) and bs > raw_bs:
        return (f"; the graph replayed bucket {bs} for {raw_bs} request(s): a padded lane may be read, "
                f"`harness check {case_name} --props {P2}` names it")
    return ""


def check_eager_vs_graph(sc: Scenario, runs: Sequence[RankRun], device: str = "cpu", tol_override: Optional[Tol] = None) -> Verdict:
    v = Verdict(P3)
    tol = tol_override or eager_vs_graph(device, sc.model.dtype, sc.attention_backend)
    T = sc.spec.num_tokens_per_bs
    for run in runs:
        for it, (eager_steps, graph_steps) in enumerate(zip(run.eager, run.graph, strict=True)):
            recs = run.records[it] if it < len(run.records) else []
            for step, (e, g) in enumerate(zip(eager_steps, graph_steps, strict=True)):
                rec = recs[step] if step < len(recs) else None
                w = {"layout": sc.layout.describe(), "rank": run.rank, "iteration": it, "step": step,
                     "raw_bs": len(run.rids[it]), "bs": rec.bs if rec else "eager"}
                rids = run.rids[it]
                label = lambda r, rids=rids: f"row {r} (request {rids[r // T] if r // T < len(rids) else '?'}, token {r % T})"  # noqa: E731
                before = len(v.failures)
                same = compare_outputs(v, "eager-vs-graph", w, e.out.tensors(), g.out.tensors(), tol, label)
                if same:
                    v.checked += 1
                    if not torch.equal(e.out.next_input_ids, g.out.next_input_ids):
                        v.fail("eager-vs-graph", "next_input_ids", w, "equal", "differs")
                        same = False
                for f in v.failures[before:]:
                    f.detail += padded_lane_hint(sc.name, w["raw_bs"], w["bs"])
                if not same:
                    break
    v.merge(check_graph_replayed(sc, runs))
    return v


def check_graph_replayed(sc: Scenario, runs: Sequence[RankRun], expect_fallbacks: int = 0) -> Verdict:
    """Every rank's graph driver replayed a graph for every step (one per iteration for the one-graph composite)."""
    v = Verdict(P3)
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


def _replays(runner: Any) -> Optional[int]:
    """A graph runner's replay count (its stats, or its backend's); None: no such runner on this engine."""
    if runner is None:
        return None
    stats = getattr(runner, "stats", None) or getattr(getattr(runner, "backend", None), "stats", None)
    return None if stats is None else stats.replays


def check_loop_replayed(v: Verdict, s: SpecSession, where: dict) -> None:
    """Every graph runner of a graph session replayed at least once. One that never did (no batch fit its buckets)
    ran every batch eagerly, and a comparison of that run with the eager one would compare eager with eager; one the
    engine never built (an eager engine, the target as its own draft) fails by name."""
    drafts = [e for e in s.engines if not (isinstance(e.draft, EagleProposer) and e.draft.worker is None)]  # a rank without a draft
    # (SpecConfig.draft_tp_size) replays no draft graph
    runners: dict[str, tuple[Callable[[Any], Any], list]] = {
        "graph replays > 0": (lambda e: getattr(e.draft, "driver", None), drafts),
        "target verify replays > 0": (lambda e: e.verify_graph, s.engines),
    }
    if s.spec.draft.has_draft_decode and s.spec.num_steps > 1:
        runners["draft decode replays > 0"] = (lambda e: getattr(e.draft, "decode_graph", None), drafts)
    for field, (runner_of, engines) in runners.items():
        counts = [_replays(runner_of(e)) for e in engines]
        missing = [e.ctx.tp_rank for e, n in zip(engines, counts, strict=True) if n is None]
        if missing:
            v.checked += 1
            v.fail("replayed", field, where, True, f"no such graph runner on rank(s) {missing}",
                   f"this {s.runner} session's engines have no graph runner here to replay: nothing was compared")
            continue
        v.expect_equal("replayed", field, where, True, sum(counts) > 0, "every batch of this runner fell back to eager")


def check(run: CaseRun) -> Verdicts:
    return {P3: check_eager_vs_graph(run.sc, run.runs, tol_override=run.case.tol("eager_vs_graph"))}


PROPERTY = Property(P3, "eager vs graph", Needs.CASE_RUN | Needs.BOTH_RUNNERS, check)
