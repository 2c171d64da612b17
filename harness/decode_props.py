"""P1, P3 and P6 over the single-layer EAGLE draft decode (runners.eagle_draft_graph.EAGLEDraftCudaGraphRunner).

P1 (fast): the runner's get_forward_batch and replay fill on every layout, metadata only: the
baked counts equal the replay fill (I1), count bs * topk lanes (I5, DECODE gives every lane
logits), and the padding rules (padded seq_lens = fill, smallest bucket). P1 (run path) and P3
through the speculative decoding loop: every draft-decode replay's record (rows fed to lm_head,
I2) and its tree (tokens, parents, children exact; scores and logits within the eager-vs-graph
tolerance) against the eager reference run of the same workload. P6: the acceptance golden of
each single-layer case, for both runners.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from harness.case import Case, load_case
from harness.layout import all_layouts
from harness.properties import check_replay_record, check_replay_rows
from harness.spec_decode import AcceptanceGoldenError, case_session, load_acceptance_golden
from harness.spec_props import compare_acceptance
from harness.tolerances import Tol, eager_vs_graph
from harness.verdict import Verdict, merge_verdicts
from runners.config import DEFAULT_MODEL, ModelConfig, SpecConfig
from runners.draft_extend import DraftWorker
from runners.eagle_draft import DraftDecodeInputs
from runners.eagle_draft_graph import EAGLEDraftCudaGraphRunner
from runners.graph_backend import GraphBackend
from runners.parallel.dp_attention import RankContext
from runners.parallel.layout import ParallelLayout

DECODE_CASES = ("tp2_single_layer_shrink", "tp4_dp2_single_layer_topk2")
EXACT = ("tokens", "parents", "child_index")
CLOSE = ("scores", "child_p", "step_logits")


def check_decode_metadata(layout: ParallelLayout, spec: SpecConfig, schedule: Sequence[Sequence[int]], model: ModelConfig = DEFAULT_MODEL,
                          seed: int = 0) -> Verdict:
    """I1 / I4 / I5 and the padding rules of the draft-decode runner of every rank, without a model."""
    v = Verdict("P1")
    k = spec.topk
    for tp_rank in range(layout.world_size):
        worker = DraftWorker(RankContext(layout, tp_rank, comm=None), model, spec, num_layers=1, build_model=False)
        runner = EAGLEDraftCudaGraphRunner(worker, GraphBackend("sim"))
        d = layout.attn_dp_rank(tp_rank)
        for it, sizes in enumerate(schedule):
            dp_sizes = list(sizes) if layout.attn_dp_size > 1 else [sizes[0]]
            raw_bs = dp_sizes[d]
            g = torch.Generator().manual_seed(seed + 1000 * it + d)
            seq = torch.randint(1, 4 * k + 8, (raw_bs,), generator=g)
            inp = DraftDecodeInputs(torch.ones(raw_bs, k), torch.zeros(raw_bs, k, dtype=torch.int64), torch.zeros(raw_bs, model.hidden_size),
                                    seq, torch.arange(1, raw_bs + 1), seq.repeat_interleave(k), dp_sizes)
            if runner.can_run(inp):
                needed = max(dp_sizes) if layout.require_mlp_tp_gather else raw_bs
                check_replay_record(v, layout, runner.prepare_replay(inp), tp_rank, it, needed)
    return v


def check_decode_case(case: Case, props: Sequence[str] = ("P1", "P3", "P6")) -> dict[str, Verdict]:
    """The case's workload through the loop, eager and graph: P1 on the draft-decode replays, P3 eager vs graph, P6 both."""
    out = {p: Verdict(p) for p in props}
    layout, k = case.layout, case.scenario.spec.topk
    sessions = {r: case_session(case, r) for r in ("eager", "graph")}
    tol = case.tol("eager_vs_graph", eager_vs_graph("cpu", case.scenario.model.dtype, case.scenario.attention_backend))
    replays = 0
    for step, (e_reps, g_reps) in enumerate(zip(sessions["eager"].reports, sessions["graph"].reports, strict=True)):
        for rank, (e, g) in enumerate(zip(e_reps, g_reps, strict=True)):
            where = {"case": case.name, "layout": layout.describe(), "runner": "draft_decode", "rank": rank, "step": step}
            for rec in g.decode_records:
                replays += 1
                if "P1" in out:
                    needed = max(rec.capture.host["global_num_tokens_cpu"] or [rec.raw_bs * k]) // k if layout.require_mlp_tp_gather else rec.raw_bs
                    check_replay_record(out["P1"], layout, rec, rank, step, needed)
                    check_replay_rows(out["P1"], layout, rec, rank, step, expected_rows=rec.bs * k)
            if "P3" in out and (e.decode_outs is None) != (g.decode_outs is None):
                out["P3"].fail("P3", "draft decode ran", where, e.decode_outs is not None, g.decode_outs is not None)
            elif "P3" in out and e.decode_outs is not None:
                _compare_tree(out["P3"], where, e.decode_outs.tensors(), g.decode_outs.tensors(), tol)
    if "P3" in out:
        out["P3"].expect_equal("P3", "draft-decode graph replays", {"case": case.name}, True, replays > 0, "the graph runner really ran")
    if "P6" in out:
        try:
            golden = load_acceptance_golden(case)
        except AcceptanceGoldenError as err:
            out["P6"].fail("golden", "file", {"case": case.name}, "a golden for this case", "none usable", str(err))
        else:
            for runner, s in sessions.items():
                compare_acceptance(out["P6"], golden, s, {"case": case.name, "layout": layout.describe(), "runner": runner})
    return out


def _compare_tree(v: Verdict, where: dict, ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], tol: Optional[Tol]) -> None:
    """Tree structure exactly (a flipped node is a different proposal); probabilities and logits within tol (None: bitwise)."""
    for name in EXACT + CLOSE:
        v.checked += 1
        a, b = ref[name], got[name]
        if a.shape != b.shape:
            v.fail("P3", name, where, tuple(a.shape), tuple(b.shape), "shape")
        elif name in EXACT and not torch.equal(a, b):
            v.fail("P3", name, where, a.tolist(), b.tolist(), "eager vs graph draft decode")
        elif name in CLOSE and not (torch.equal(a, b) if tol is None else torch.allclose(a, b, rtol=tol.rtol, atol=tol.atol)):
            v.fail("P3", name, where, "match", f"max |diff| {(a - b).abs().max().item():.3g}",
                   "bitwise" if tol is None else f"rtol={tol.rtol} atol={tol.atol}: {tol.reason}")


METADATA_SPECS = (SpecConfig(num_steps=3, topk=1, capture_bs=(1, 2, 4, 8), max_running_requests=8, draft="single_layer"),
                  SpecConfig(num_steps=3, topk=2, capture_bs=(1, 2, 4, 8), max_running_requests=8, draft="single_layer"))
METADATA_SCHEDULE = ((6, 3, 5, 1, 2, 4, 7, 8), (2, 1, 1, 0, 1, 2, 1, 3), (1, 2, 1, 1, 1, 1, 1, 1))  # shrinks across buckets, uneven DP groups


def probe_draft_decode() -> dict[str, Verdict]:
    """P1 metadata on every layout (topk 1 and 2), then P1 / P3 / P6 over the single-layer cases."""
    v = Verdict("P1")
    for spec in METADATA_SPECS:
        for layout in all_layouts():
            dp = layout.attn_dp_size
            sched = [tuple(row[:dp]) if dp > 1 else row[:1] for row in METADATA_SCHEDULE]
            sched = [s if sum(s) else (1,) + tuple(s[1:]) for s in sched]
            v.merge(check_decode_metadata(layout, spec, sched))
    out = {"P1": v}
    for name in DECODE_CASES:
        merge_verdicts(out, check_decode_case(load_case(name)))
    return out
