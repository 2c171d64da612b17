"""A draft with a TP size and a config of its own (runners.draft_parallel, runners.config.draft_model_config): which ranks
hold it and in which layout, how its proposals reach the others, its rotary table, and its shipped case."""
import math
from dataclasses import replace

import pytest
import torch

from harness.cases.case import default_cases, load_case
from harness.golden.acceptance import GOLDEN_CASES
from harness.pipeline.check import check_case
from harness.pipeline.mutants import single_group_case
from harness.props.draft_decode import check_decode_case
from harness.props.draft_probes import DRAFT_TP_CASE
from harness.props.p2 import check_padded_lanes
from harness.ranks.simulated import SimulatedWorld
from harness.run.loop import SpecSession, Workload, acceptance_stats, run_workload
from runners.config import ModelConfig, SpecConfig, draft_model_config
from runners.draft_extend import DraftWorker
from runners.draft_parallel import DraftRankContext, draft_rank_context, handoff_proposals, served_dp_rank
from runners.parallel.comm import Group
from runners.parallel.dp_attention import RankContext
from runners.parallel.layout import LayoutError
from runners.parallel.layout import ParallelLayout as PL
from runners.scheduler import Proposal

TP4_DP2 = PL(4, 2, True)


def _contexts(layout: PL, spec: SpecConfig):
    return SimulatedWorld(layout).run(lambda comm: draft_rank_context(RankContext(layout, comm.rank, comm), spec))


def test_a_tp1_draft_sits_on_the_first_rank_of_each_attention_group():
    ctxs = _contexts(TP4_DP2, SpecConfig(draft_tp_size=1))
    assert ctxs[1] is None and ctxs[3] is None  # no draft on the second rank of each attention-TP group
    for rank, dp in ((0, 0), (2, 1)):
        c = ctxs[rank]
        assert isinstance(c, DraftRankContext) and c.layout == PL() and c.tp_rank == 0
        assert served_dp_rank(c) == dp  # the DP group whose requests it drafts for
        assert c.comm.group_ranks(Group.WORLD) == [rank]  # its collectives: itself


def test_a_draft_at_the_attention_tp_size_spans_its_group_only():
    ctxs = _contexts(TP4_DP2, SpecConfig(draft_tp_size=2))
    assert [c.tp_rank for c in ctxs] == [0, 1, 0, 1] and all(c.layout == PL(2) for c in ctxs)
    assert [c.comm.group_ranks(Group.WORLD) for c in ctxs] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [c.comm.group_ranks(Group.ATTN_DP) for c in ctxs] == [[0], [1], [2], [3]]


def test_without_a_draft_tp_size_the_draft_is_in_the_targets_context():
    ctx = RankContext(TP4_DP2, 3, comm=None)
    assert draft_rank_context(ctx, SpecConfig()) is ctx


def test_a_draft_tp_size_outside_the_attention_group_is_refused():
    with pytest.raises(LayoutError, match="spec.draft_tp_size: 1 or the target's attn_tp_size"):
        draft_rank_context(RankContext(TP4_DP2, 0, comm=None), SpecConfig(draft_tp_size=4))


def test_the_first_rank_hands_its_proposals_to_the_rest_of_its_group():
    mine = [Proposal([7, 8], [[7, 1], [8, 2]]), Proposal([3, 4], [[3, 5], [4, 6]])]

    def run(comm):
        ctx = RankContext(PL(2), comm.rank, comm)
        return handoff_proposals(ctx, mine if comm.rank == 0 else None, 2, 2, 2, torch.device("cpu"))

    assert SimulatedWorld(PL(2)).run(run) == [mine, mine]


# ---------------------------------------------------------------- the draft's own config


def test_the_drafts_rotary_table_has_its_own_base_and_the_targets_positions():
    cfg = ModelConfig()  # max_context_len 64, rope_theta 1e4
    own = draft_model_config(cfg, SpecConfig(draft_max_position_embeddings=24, draft_rope_theta=5e5))
    assert (own.max_context_len, own.rope_theta) == (64, 5e5)  # 24 positions raised to the target's 64
    assert draft_model_config(cfg, SpecConfig(draft_max_position_embeddings=100)).max_context_len == 100
    assert draft_model_config(cfg, SpecConfig()) == cfg
    spec = SpecConfig(draft="single_layer", draft_max_position_embeddings=24, draft_rope_theta=5e5)
    table = DraftWorker(RankContext(PL(), 0, comm=None), cfg, spec, num_layers=1).model.layers[0].layer.cos_sin_cache
    d = cfg.head_dim  # 8: frequencies theta^(-j/4), j = 0..3; row p = cos(p f_j) | sin(p f_j)
    p, j = 63, 3
    assert table.shape == (64, d)
    assert math.isclose(float(table[p, j]), math.cos(p * 5e5 ** (-2 * j / d)), rel_tol=1e-6)
    assert math.isclose(float(table[p, d // 2 + j]), math.sin(p * 5e5 ** (-2 * j / d)), rel_tol=1e-5)


# ---------------------------------------------------------------- the shipped case


def test_the_case_is_shipped_with_every_golden_and_in_every_parametrized_check():
    assert DRAFT_TP_CASE in [c.name for c in default_cases()] and DRAFT_TP_CASE in GOLDEN_CASES
    out = check_decode_case(load_case(DRAFT_TP_CASE))  # P1 in the draft's layout, P3 trees, P6 both goldens
    assert set(out) == {"P1", "P3", "P6"} and all(v.ok for v in out.values()), {k: v.report(3) for k, v in out.items()}


def test_harness_check_runs_the_draft_on_its_own_ranks_only():
    rep = check_case(load_case(DRAFT_TP_CASE))
    assert rep.ok, rep.first_failure()
    by_rank = {run.rank: run for run in rep.runs}
    assert not by_rank[1].graph and not by_rank[3].graph  # no draft there
    for rank in (0, 2):
        recs = [rec for recs in by_rank[rank].records for rec in recs]
        assert recs and {rec.branch for rec in recs} == {"neither"}  # the draft's plain-TP layout, not the target's MLP-TP gather


def test_the_draft_computes_the_same_in_its_own_placement_as_in_the_targets():
    """Acceptance is the draft's function of the same weights: in the target's layout or on one rank per attention-TP
    group (proposals handed on), every request accepts the same tokens."""
    case = load_case(DRAFT_TP_CASE)
    sc, wl = case.scenario, Workload(((3, 1), (1, 2)), 2)
    got = [acceptance_stats(run_workload(SpecSession(sc.layout, spec, sc.model), wl))["requests"]
           for spec in (sc.spec, replace(sc.spec, draft_tp_size=None))]
    assert got[0] == got[1]
    assert sum(a for r in got[0].values() for a in r["accept_lens"]) > len([a for r in got[0].values() for a in r["accept_lens"]])


def test_p2_holds_where_some_ranks_hold_no_draft():
    v = check_padded_lanes(load_case(DRAFT_TP_CASE))
    assert "run" not in v and v["P2"].ok, v["P2"].report()


def test_the_single_group_placement_matches_tp1():
    """SGLang's EAGLE3 under DP attention: the draft at TP2 inside each attention-TP group of TP4 DP2; P1, P3, P4."""
    out = check_case(single_group_case()).verdicts
    assert set(out) == {"P1", "P3", "P4"} and all(v.ok for v in out.values()), {k: v.report(3) for k, v in out.items()}
