"""Mixed forward modes across DP ranks in one iteration (runners.mixed_modes): the gathered modes by hand, the SUM_LEN
gather by hand and against MAX_LEN through the model, the mixed case through the loop with P7, and its mutants caught."""
import pytest
import torch

from harness import mutants
from harness.cases.case import CaseError, load_case, parse_case
from harness.pipeline.check import check_case
from harness.props.collectives import check_mixed_modes
from harness.ranks.simulated import SimulatedWorld
from harness.run.loop import case_session
from runners.batch import ForwardMode
from runners.config import ModelConfig
from runners.memory import ReqToTokenPool
from runners.mixed_modes import DpIteration, MlpSyncInfo, PhaseSync, gather_mlp_sync_info
from runners.parallel.dp_attention import RankContext, dp_gather_sum_len
from runners.parallel.layout import DpPaddingMode
from runners.parallel.layout import ParallelLayout as PL
from runners.target import Lane, TargetRunner

EXT, VER, IDLE = ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE
MIXED_CASE = "tp3_dp3_mixed_modes"


def test_every_group_learns_every_groups_tokens_and_mode():
    lay = PL(3, 3, True)
    local = {0: (7, EXT), 1: (8, VER), 2: (0, IDLE)}  # a prompt of 7 tokens, 2 requests of 4 verify tokens, nothing

    def fn(comm):
        n, mode = local[comm.rank]
        return gather_mlp_sync_info(RankContext(lay, comm.rank, comm), n, n, mode, torch.device("cpu"))

    infos = SimulatedWorld(lay).run(fn)
    assert all(info == MlpSyncInfo((7, 8, 0), (7, 8, 0), (EXT, VER, IDLE)) for info in infos)
    assert infos[0].is_extend_in_batch


@pytest.mark.parametrize("mode", [EXT, VER, IDLE])
def test_the_gathered_modes_decide_padding_and_graphs_the_local_mode_decides_the_passes(mode):
    mixed = MlpSyncInfo((7, 8, 0), (7, 8, 0), (EXT, VER, IDLE))
    it = DpIteration(mode, mixed, dp_rank=[EXT, VER, IDLE].index(mode))
    assert PhaseSync.of(it) == PhaseSync([7, 8, 0], DpPaddingMode.SUM_LEN, graphs=False)  # the same on every group
    assert it.runs_prefill() == (mode is not VER)  # the idle group joins the extending group's passes
    decode = DpIteration(IDLE if mode is IDLE else VER, MlpSyncInfo((4, 8, 0), (4, 8, 0), (VER, VER, IDLE)), 0)  # no group extends
    assert PhaseSync.of(decode) == PhaseSync([4, 8, 0], DpPaddingMode.MAX_LEN, graphs=True)
    assert not decode.runs_prefill()


def test_sum_len_gather_concatenates_the_groups_rows_unpadded():
    lay = PL(4, 2, True)  # two groups of two attn-TP ranks: each group's rows written once, summed over the world
    counts = [3, 1]

    def fn(comm):
        ctx = RankContext(lay, comm.rank, comm)
        local = torch.full((counts[ctx.attn_dp_rank], 2), float(10 * ctx.attn_dp_rank + 1)) + torch.arange(counts[ctx.attn_dp_rank])[:, None]
        return dp_gather_sum_len(ctx, local, counts, sum(counts))

    want = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [11.0, 11.0]])
    for got in SimulatedWorld(lay).run(fn):
        torch.testing.assert_close(got, want)


def test_a_target_pass_gathered_sum_len_equals_max_len():
    """Uneven DP groups (a 6-token prefill, a 2-token lane, nothing): the SUM_LEN pass computes what the padded one does."""
    lay = PL(3, 3, True)
    cfg = ModelConfig(vocab_size=513, intermediate_size=129)
    lanes = {0: [Lane(1, 0, [5, 9, 2, 7, 1, 3])], 1: [Lane(1, 0, [4, 8])], 2: []}
    dp_tokens = [6, 2, 0]

    def fn(comm):
        ctx = RankContext(lay, comm.rank, comm)
        pool = ReqToTokenPool(2, cfg.max_context_len, torch.device("cpu"))
        pool.req_to_token[1, :8] = torch.arange(1, 9)
        t = TargetRunner(ctx, cfg, pool, 16, torch.device("cpu"))
        return [t.forward_synced(lanes[comm.rank], dp_tokens, mode).logits for mode in (DpPaddingMode.MAX_LEN, DpPaddingMode.SUM_LEN)]

    for rank, (max_len, sum_len) in enumerate(SimulatedWorld(lay).run(fn)):
        assert sum_len.shape[0] == dp_tokens[rank]
        # fp32 sums of the world's MLP shards in another order (an all-reduce of a buffer vs a reduce-scatter): a few ulps
        torch.testing.assert_close(sum_len, max_len, rtol=1e-5, atol=1e-5)


def test_the_case_mixes_extend_verify_and_idle_and_every_steps_collectives_agree():
    case = load_case(MIXED_CASE)
    assert case.scenario.spec.dp_spec_prefill_coordination
    s = case_session(case, "graph")
    v = check_mixed_modes(s, {"case": MIXED_CASE})
    assert v.ok and v.checked > 100, v.report()
    modes = [reps[0].dp_forward_modes for reps in s.reports]
    assert ["TARGET_VERIFY", "EXTEND", "IDLE"] in modes  # phase 1's first step: group 1's new request joins
    assert sum(e.verify_graph.backend.stats.replays for e in s.engines) > 0  # the decode-only steps replay graphs


def test_harness_check_catches_a_decoding_group_routed_on_the_global_flag():
    """The case's loop under `harness check --props all`: a decoding group that takes the prefill path whenever another
    group extends skips its verify; the collectives still agree (P7 holds), the accept lengths per round move (P6)."""
    with mutants.get("mixed-decode-routed-to-prefill").planted():
        out = check_case(load_case(MIXED_CASE), props=("P5", "P6")).verdicts
    assert out["P7"].ok and not out["P6"].ok, {k: v.ok for k, v in out.items()}


def test_coordination_needs_dp_attention():
    data = {"name": "x", "description": "d", "layout": {"tp_size": 2}, "spec": {"dp_spec_prefill_coordination": True}, "schedule": {"batches": [[1]]}}
    with pytest.raises(CaseError, match="spec.dp_spec_prefill_coordination: expected false without DP attention"):
        parse_case(data, "x.toml")
