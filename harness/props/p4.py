"""P4 cross-layout: every layout's rows equal TP1 eager's rows of the same requests (the oracle), request by request,
within a tolerance that allows only the reordered sums of TP shards."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from harness.props.base import Needs, Probe, Property, Verdicts
from harness.props.draft_decode import compare_tree
from harness.props.outputs import compare_requests
from harness.props.p3 import padded_lane_hint
from harness.props.tolerances import Tol, cross_layout
from harness.ranks.simulated import SimulatedWorld
from harness.run.case_run import CaseRun
from harness.run.rig import RankRun, StepResult
from harness.run.scenario import Scenario
from harness.verdict import Verdict
from runners.config import DEFAULT_MODEL, ModelConfig, SpecConfig
from runners.draft_extend import SEQ_LEN_FILL_VALUE, DraftWorker, StepOutputs
from runners.eagle_draft import DraftDecodeInputs, run_eager_decode
from runners.memory import PADDING_ROW
from runners.parallel.dp_attention import RankContext
from runners.parallel.layout import ParallelLayout

P4 = "P4"
REQUEST_FIELDS = ("logits", "hidden", "logprobs", "topk_p", "topk_index")


def _rows_by_request(run: RankRun, it: int, res: StepResult, T: int) -> dict[int, dict]:
    out: StepOutputs = res.out
    return {rid: {"logits": out.logits[i * T : (i + 1) * T], "hidden": out.hidden[i * T : (i + 1) * T], "logprobs": out.logprobs[i : i + 1],
                  "topk_p": out.topk_p[i : i + 1], "topk_index": out.topk_index[i : i + 1]}
            for i, rid in enumerate(run.rids[it])}


def check_cross_layout(
    sc: Scenario, runs: Sequence[RankRun], oracle: Sequence[RankRun], runner: str = "eager", tol_override: Optional[Tol] = None
) -> Verdict:
    """P4: each rank's rows equal TP1 eager's rows of the same requests, within CROSS_LAYOUT."""
    v = Verdict(P4)
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
                items = []
                for rid, g in got.items():
                    if rid in diverged:
                        continue
                    w = {"layout": sc.layout.describe(), "runner": runner, "rank": run.rank, "iteration": it, "step": step, "request": rid}
                    label = lambda r, rid=rid: f"row {r} of request {rid} (token {r})"  # noqa: E731
                    items.append((w, ref[rid], g, label))
                for (w, _, _, _), same in zip(items, compare_requests(v, "vs-tp1", items, tol), strict=True):
                    if not same:
                        diverged.add(w["request"])
    return v


def _hint_graph_only(sc: Scenario, runs: Sequence[RankRun], eager: Verdict, graph: Verdict) -> None:
    """A request the graph runner gets wrong where the eager runner of the same run gets it right, on a padded bucket,
    points at the padded lanes."""
    eager_wrong = {(f.where["rank"], f.where["iteration"], f.where["step"], f.where["request"]) for f in eager.failures}
    by_rank = {r.rank: r for r in runs}
    for f in graph.failures:
        w = f.where
        if (w["rank"], w["iteration"], w["step"], w["request"]) in eager_wrong:
            continue
        run = by_rank[w["rank"]]
        recs = run.records[w["iteration"]] if w["iteration"] < len(run.records) else []
        rec = recs[w["step"]] if w["step"] < len(recs) else None
        if rec is not None:
            f.detail += padded_lane_hint(sc.name, len(run.rids[w["iteration"]]), rec.bs)


def check(run: CaseRun) -> Verdicts:
    tol = run.case.tol("cross_layout", None)  # a case's [tolerances] table overrides harness/props/tolerances.py
    found = {kind: check_cross_layout(run.sc, run.runs, run.oracle, kind, tol_override=tol) for kind in run.runner_kinds}
    if "eager" in found and "graph" in found:
        _hint_graph_only(run.sc, run.runs, found["eager"], found["graph"])
    v = Verdict(P4)
    for kind in run.runner_kinds:
        v.merge(found[kind])
    return {P4: v}


# ---- the draft decode on a kernel backend vs the torch reference backend's, the same inputs ----
KERNEL_BACKENDS = ("triton",)  # the backends with a draft-decode kernel that run on CPU (flashinfer: tests/test_gpu_runners.py)


def check_decode_backend(backend: str, topk: int, model: ModelConfig = DEFAULT_MODEL) -> Verdict:
    """TP1 eager draft decode on `backend` against the torch reference backend (the oracle, as TP1 eager is P4's):
    three requests with live KV past their seq_len and a fourth lane as the replay fills one (the padding row, seq_len
    = fill, position 0). The tree exactly; probabilities and logits within P4's bound (the kernel's reassociated
    attention sums, attn_vs_reference, carried through one layer and the lm_head; a key read wrongly is O(1))."""
    v = Verdict(P4)
    where = {"layout": "tp1", "runner": "draft_decode", "backend": backend, "oracle": "torch", "topk": topk}
    spec = SpecConfig(num_steps=3, topk=topk, capture_bs=(4,), max_running_requests=4, draft="single_layer")

    def run(comm) -> dict[str, dict[str, torch.Tensor]]:
        ctx = RankContext(ParallelLayout(), 0, comm)
        g = torch.Generator().manual_seed(11)
        kv = torch.randn(2, 320, model.num_kv_heads, model.head_dim, generator=g)  # TP1: every KV head
        seq = torch.cat([torch.randint(5, 40, (3,), generator=g), torch.tensor([SEQ_LEN_FILL_VALUE])])
        inp = DraftDecodeInputs(torch.rand(4, topk, generator=g).sort(dim=1, descending=True).values,
                                torch.randint(0, model.vocab_size, (4, topk), generator=g), torch.randn(4, model.hidden_size, generator=g),
                                seq, torch.tensor([1, 2, 3, PADDING_ROW]), torch.cat([seq[:3], torch.zeros(1, dtype=seq.dtype)]).repeat_interleave(topk),
                                [4])
        trees = {}
        for name in ("torch", backend):
            w = DraftWorker(ctx, model, spec, num_layers=1, attention_backend=name, max_reqs=8, num_slots=320)
            for r in range(1, 5):  # request r owns slots 64r .. 64r + 63, all holding KV
                w.req_pool.req_to_token[r] = torch.arange(r * 64, r * 64 + 64)
            w.kv_pool.k[0].copy_(kv[0])
            w.kv_pool.v[0].copy_(kv[1])
            trees[name] = run_eager_decode(w, inp).tensors()
        return trees

    trees = SimulatedWorld(ParallelLayout()).run(run)[0]
    compare_tree(v, where, trees["torch"], trees[backend], cross_layout(model.dtype, backend), prop=P4)
    return v


def _draft_decode_backends() -> Verdicts:
    """Every kernel backend against the reference, topk 1 and 2."""
    v = Verdict(P4)
    for backend in KERNEL_BACKENDS:
        for topk in (1, 2):
            v.merge(check_decode_backend(backend, topk))
    return {P4: v}


PROPERTY = Property(
    P4, "cross-layout vs TP1 eager", Needs.CASE_RUN | Needs.ORACLE, check,
    # the draft decode on each kernel backend against the torch reference backend's, the same inputs (the reference as oracle)
    probes=(Probe.guarded("draft-decode-backends", _draft_decode_backends),),
)
