"""P4: every layout against TP1 eager, request by request."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from harness.execute import RankRun
from harness.props.outputs import compare_outputs
from harness.scenario import Scenario
from harness.tolerances import Tol, cross_layout
from harness.verdict import Verdict


def _rows_by_request(run: RankRun, it: int, step_results, T: int) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for i, rid in enumerate(run.rids[it]):
        t = step_results.tensors
        out[rid] = {
            "logits": t["logits"][i * T : (i + 1) * T],
            "hidden": t["hidden"][i * T : (i + 1) * T],
            "logprobs": t["logprobs"][i : i + 1],
            "topk_p": t["topk_p"][i : i + 1],
            "topk_index": t["topk_index"][i : i + 1],
        }
    return out


def check_cross_layout(
    sc: Scenario, runs: Sequence[RankRun], oracle: Sequence[RankRun], runner: str = "eager", tol_override: Optional[Tol] = None
) -> Verdict:
    """P4: each rank's rows equal TP1 eager's rows of the same requests, within CROSS_LAYOUT."""
    v = Verdict("P4")
    tol = tol_override or cross_layout(sc.model.dtype, sc.attention_backend)
    T = sc.spec.num_tokens_per_bs
    ref_run = oracle[0]
    for run in runs:
        results = run.eager if runner == "eager" else run.graph
        for it, steps in enumerate(results):
            diverged: set[int] = set()
            for step, res in enumerate(steps):
                ref = _rows_by_request(ref_run, it, ref_run.eager[it][step], T)
                got = _rows_by_request(run, it, res, T)
                for rid, g in got.items():
                    if rid in diverged:
                        continue
                    w = {"layout": sc.layout.describe(), "runner": runner, "rank": run.rank, "iteration": it, "step": step, "request": rid}
                    label = lambda r, rid=rid: f"row {r} of request {rid} (token {r})"  # noqa: E731
                    if not compare_outputs(v, "vs-tp1", w, ref[rid], g, tol, label):
                        diverged.add(rid)
    return v
