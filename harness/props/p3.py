"""P3: eager vs graph, per draft step, real rows only."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from harness.execute import RankRun
from harness.props.outputs import compare_outputs
from harness.props.p1_run import check_graph_replayed
from harness.scenario import Scenario
from harness.tolerances import Tol, eager_vs_graph
from harness.verdict import Verdict


def check_eager_vs_graph(sc: Scenario, runs: Sequence[RankRun], device: str = "cpu", tol_override: Optional[Tol] = None) -> Verdict:
    v = Verdict("P3")
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
                if not compare_outputs(v, "eager-vs-graph", w, e.tensors, g.tensors, tol, label):
                    break
                v.checked += 1
                if not torch.equal(e.tensors["next_input_ids"], g.tensors["next_input_ids"]):
                    v.fail("eager-vs-graph", "next_input_ids", w, "equal", "differs")
                    break
    v.merge(check_graph_replayed(sc, runs))
    return v

