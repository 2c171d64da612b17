"""P1, P2, P3 and P6 over the single-layer EAGLE draft decode (runners.eagle_draft_cuda_graph_runner.EAGLEDraftCudaGraphRunner);
its P4 (each kernel backend against the torch reference's) is harness.props.p4's.

P1 (fast): the runner's get_forward_batch and replay fill on every layout, metadata only: the
baked counts equal the replay fill (I1), count bs * topk lanes (I5, DECODE gives every lane
logits), and the padding rules (padded seq_lens = fill, smallest bucket). P1 (run path) and P3
through the speculative decoding loop: every draft-decode replay's record (rows fed to lm_head,
I2) and its tree (tokens, parents, children exact; scores and logits within the eager-vs-graph
tolerance) against the eager reference run of the same workload. P2: every padded buffer poisoned
before a replay after a shrink; the real trees and every live KV slot must not notice. P6: the acceptance golden of
each single-layer case and its draft-tree golden (harness.golden.draft_tree), for
both runners.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from harness.cases.case import Case, load_case
from harness.golden.acceptance import AcceptanceGoldenError, load_acceptance_golden
from harness.golden.draft_tree import TREE_CASES, check_tree_golden
from harness.props.base import Probe
from harness.props.p1_metadata import check_decode_metadata
from harness.props.p1_records import P1, check_replay_record, check_replay_rows
from harness.props.p3 import P3
from harness.props.p6_acceptance import P6, compare_acceptance
from harness.props.poison import P2
from harness.props.tolerances import Tol, eager_vs_graph
from harness.ranks.simulated import SimulatedWorld
from harness.run.layouts import all_layouts
from harness.run.loop import case_session
from harness.verdict import Verdict
from runners.config import DEFAULT_MODEL, ModelConfig, SpecConfig
from runners.draft_extend import DraftWorker
from runners.draft_parallel import draft_layout
from runners.eagle_draft import DraftDecodeInputs, run_eager_decode
from runners.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
from runners.graph.backend import GraphBackend
from runners.parallel.dp_attention import RankContext
from runners.parallel.layout import ParallelLayout

EXACT = ("tokens", "parents", "child_index")
CLOSE = ("scores", "child_p", "step_logits")


def check_decode_case(case: Case, props: Sequence[str] = (P1, P3, P6)) -> dict[str, Verdict]:
    """The case's workload through the loop, eager and graph: P1 on the draft-decode replays, P3 eager vs graph,
    P6 (accept lengths, and the draft trees behind them) for both."""
    out = {p: Verdict(p) for p in props}
    layout, k = draft_layout(case.layout, case.scenario.spec), case.scenario.spec.topk  # the draft's (SpecConfig.draft_tp_size)
    sessions = {r: case_session(case, r) for r in ("eager", "graph")}
    tol = case.tol("eager_vs_graph", eager_vs_graph("cpu", case.scenario.model.dtype, case.scenario.attention_backend))
    replays = 0
    graph_records = sessions["graph"].records
    for step, (e_reps, g_reps) in enumerate(zip(sessions["eager"].reports, sessions["graph"].reports, strict=True)):
        for rank, (e, g) in enumerate(zip(e_reps, g_reps, strict=True)):
            where = {"case": case.name, "layout": layout.describe(), "runner": "draft_decode", "rank": rank, "step": step}
            for i, rec in enumerate(graph_records[step][rank].decode):
                replays += 1
                if P1 in out:
                    # every DP group replays the largest group's bucket in the MLP branch: the largest raw batch of this replay decides
                    # (a step may run two draft decodes, the prefill's and the draft-extend's, each synced over every rank)
                    same = [rr.decode[i].raw_bs for rr in graph_records[step] if i < len(rr.decode)]
                    needed = max(same) if layout.require_mlp_tp_gather else rec.raw_bs
                    check_replay_record(out[P1], layout, rec, rank, step, needed)
                    check_replay_rows(out[P1], layout, rec, rank, step, expected_rows=rec.bs * k)
            if P3 in out and (e.decode_outs is None) != (g.decode_outs is None):
                out[P3].fail(P3, "draft decode ran", where, e.decode_outs is not None, g.decode_outs is not None)
            elif P3 in out and e.decode_outs is not None:
                compare_tree(out[P3], where, e.decode_outs.tensors(), g.decode_outs.tensors(), tol)
    if P3 in out:
        out[P3].expect_equal(P3, "draft-decode graph replays", {"case": case.name}, True, replays > 0, "the graph runner really ran")
    if P6 in out:
        check_tree_golden(out[P6], case, sessions)
        try:
            golden = load_acceptance_golden(case)
        except AcceptanceGoldenError as err:
            out[P6].fail("golden", "file", {"case": case.name}, "a golden for this case", "none usable", str(err))
        else:
            for runner, s in sessions.items():
                compare_acceptance(out[P6], golden, s, {"case": case.name, "layout": layout.describe(), "runner": runner})
    return out


def compare_tree(v: Verdict, where: dict, ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], tol: Optional[Tol],
                  prop: str = P3) -> None:
    """Tree structure exactly (a flipped node is a different proposal); probabilities and logits within tol (None: bitwise)."""
    for name in EXACT + CLOSE:
        v.checked += 1
        a, b = ref[name], got[name]
        if a.shape != b.shape:
            v.fail(prop, name, where, tuple(a.shape), tuple(b.shape), "shape")
        elif name in EXACT and not torch.equal(a, b):
            v.fail(prop, name, where, a.tolist(), b.tolist(), "eager vs graph draft decode" if prop == P3 else "vs the reference")
        elif name in CLOSE and not (torch.equal(a, b) if tol is None else torch.allclose(a, b, rtol=tol.rtol, atol=tol.atol)):
            v.fail(prop, name, where, "match", f"max |diff| {(a - b).abs().max().item():.3g}",
                   "bitwise" if tol is None else f"rtol={tol.rtol} atol={tol.atol}: {tol.reason}")


# ---- P2: poison the padded lanes of every draft-decode buffer; the fill must make the poison harmless ----
def _poison(runner: EAGLEDraftCudaGraphRunner, raw_bs: int, live_row: int) -> None:
    """Out-of-range positions and token ids (an unguarded read fails, as an out-of-bounds read would on a GPU), a live
    request's row and a long seq_len (a write through them lands in live KV), NaN probabilities and hidden states."""
    k = runner.T
    runner.positions[raw_bs * k:].fill_(10**6)
    runner.topk_index[raw_bs:].fill_(runner.worker.cfg.vocab_size + 7)
    runner.req_pool_indices[raw_bs:].fill_(live_row)
    runner.seq_lens[raw_bs:].fill_(3)
    runner.topk_p[raw_bs:].fill_(float("nan"))
    runner.hidden_states[raw_bs:].fill_(float("nan"))


def check_decode_padded_lanes(topk: int, model: ModelConfig = DEFAULT_MODEL) -> Verdict:
    """TP1: requests 1-3 in bucket 4 with every padded buffer poisoned and request 4 live but not in the batch: the
    real trees match the eager reference and no KV slot outside the batch's draft slots (and the padding slot) moves."""
    v = Verdict(P2)
    where = {"layout": "tp1", "runner": "draft_decode", "topk": topk, "raw_bs": 3, "bs": 4}
    spec = SpecConfig(num_steps=3, topk=topk, capture_bs=(1, 2, 4), max_running_requests=4, draft="single_layer")

    def run(comm) -> None:
        ctx = RankContext(ParallelLayout(), 0, comm)
        eager, graph = (DraftWorker(ctx, model, spec, num_layers=1, max_reqs=8, num_slots=512) for _ in range(2))
        kv = torch.randn(graph.kv_pool.k[0].shape, generator=torch.Generator().manual_seed(1))
        for w in (eager, graph):
            for r in range(1, 8):  # request r owns slots 64r .. 64r + 63; row 0 stays the padding row
                w.req_pool.req_to_token[r] = torch.arange(r * 64, r * 64 + 64)
            w.kv_pool.k[0].copy_(kv)
            w.kv_pool.v[0].copy_(kv)
        runner = EAGLEDraftCudaGraphRunner(graph, GraphBackend("sim"))
        runner.capture()
        g = torch.Generator().manual_seed(7)
        seq = torch.randint(5, 30, (3,), generator=g)
        inp = DraftDecodeInputs(torch.rand(3, topk, generator=g).sort(dim=1, descending=True).values,
                                torch.randint(0, model.vocab_size, (3, topk), generator=g), torch.randn(3, model.hidden_size, generator=g),
                                seq, torch.tensor([1, 2, 3]), seq.repeat_interleave(topk), [3])
        ref = run_eager_decode(eager, inp)
        before = graph.kv_pool.k[0].clone()
        _poison(runner, 3, live_row=4)
        try:
            got = runner.replay(inp)
        except (IndexError, RuntimeError) as err:
            v.fail(P2, "replay", where, "a replay", f"{type(err).__name__}: {str(err).splitlines()[0][:160]}", "a poisoned padded lane was read")
            return
        compare_tree(v, where, ref.tensors(), got.tensors(), eager_vs_graph("cpu", model.dtype))
        moved = (before != graph.kv_pool.k[0]).flatten(1).any(dim=1)
        moved[0] = False  # the padding slot
        for r, s0 in zip((1, 2, 3), seq.tolist(), strict=True):
            moved[64 * r + s0: 64 * r + s0 + topk * (spec.num_steps - 1)] = False
        v.expect_equal(P2, "live KV", where, [], moved.nonzero().flatten().tolist(), "slots a padded lane wrote (request 4 owns 256..319)")

    SimulatedWorld(ParallelLayout()).run(run)
    return v


METADATA_SPECS = (SpecConfig(num_steps=3, topk=1, capture_bs=(1, 2, 4, 8), max_running_requests=8, draft="single_layer"),
                  SpecConfig(num_steps=3, topk=2, capture_bs=(1, 2, 4, 8), max_running_requests=8, draft="single_layer"))
METADATA_SCHEDULE = ((6, 3, 5, 1, 2, 4, 7, 8), (2, 1, 1, 0, 1, 2, 1, 3), (1, 2, 1, 1, 1, 1, 1, 1))  # shrinks across buckets, uneven DP groups


def _metadata_every_layout() -> dict[str, Verdict]:
    v = Verdict(P1)
    for spec in METADATA_SPECS:
        for layout in all_layouts():
            dp = layout.attn_dp_size
            sched = [tuple(row[:dp]) if dp > 1 else row[:1] for row in METADATA_SCHEDULE]
            sched = [s if sum(s) else (1,) + tuple(s[1:]) for s in sched]
            v.merge(check_decode_metadata(layout, spec, sched))
    return {P1: v}


# P1 metadata on every layout (topk 1 and 2), P2 on poisoned padded lanes, then P1 / P3 / P6 over each single-layer case
probe_draft_decode = Probe.of("draft-decode", (
    Probe.guarded("draft-decode:metadata", _metadata_every_layout),
    Probe.guarded("draft-decode:padded-lanes", lambda: {P2: check_decode_padded_lanes(1).merge(check_decode_padded_lanes(2))}),
    *(Probe.guarded(f"draft-decode:{name}", lambda name=name: check_decode_case(load_case(name))) for name in TREE_CASES),
))
