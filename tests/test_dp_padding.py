"""Eager DP padding (runners.mlp_sync): a short or idle DP rank's eager batch padded to the DP
maximum before the forward and unpadded after, with padded lanes as harmless as a graph's."""
from unittest import mock

import torch

from harness import mutants
from harness.cases.case import load_case
from harness.pipeline.check import check_case
from harness.props.p5 import check_spec_case
from runners import mlp_sync
from runners.config import ModelConfig, SpecConfig
from runners.draft_extend import SEQ_LEN_FILL_VALUE, DraftExtendInputs, DraftWorker, eager_forward_batch
from runners.memory import PADDING_ROW
from runners.parallel.dp_attention import RankContext
from runners.parallel.layout import ParallelLayout as PL
from runners.target import Lane, extend_batch

SPEC = SpecConfig(num_steps=2, capture_bs=(1, 2, 4), max_running_requests=4)  # T = 3
MLP_DP2 = PL(4, 2, True)


def draft_batch(layout, raw_bs, dp_sizes, tp_rank=0):
    w = DraftWorker(RankContext(layout, tp_rank, comm=None), ModelConfig(), SPEC, build_model=False)
    T = w.tokens_per_bs
    n = raw_bs * T
    inp = DraftExtendInputs(
        torch.arange(100, 100 + n), torch.arange(n) + 5, torch.full((raw_bs,), 9), torch.arange(7, 7 + raw_bs),
        torch.ones(n, ModelConfig().hidden_size), torch.full((raw_bs,), 2), dp_sizes,
    )
    return w, eager_forward_batch(w, inp, inp.input_ids, inp.hidden_states)


def test_short_draft_extend_rank_padded_to_the_dp_maximum():
    """DP rank 0 has 1 request, rank 1 has 3 (T = 3): rank 0 runs 3 lanes, two of them padding. By hand."""
    w, fb = draft_batch(MLP_DP2, 1, [1, 3])
    padded, pad = mlp_sync.prepare_mlp_sync_batch(fb, MLP_DP2, [3, 9], 3)
    assert pad == mlp_sync.MlpSyncPadding(original_batch_size=1, original_num_tokens=3)
    assert padded.batch_size == 3 and padded.num_tokens == 9 and padded.extend_num_tokens == 9
    assert padded.input_ids.tolist() == [100, 101, 102] + [0] * 6
    assert padded.positions.tolist() == [5, 6, 7] + [0] * 6
    assert padded.req_pool_indices.tolist() == [7, PADDING_ROW, PADDING_ROW]
    assert padded.seq_lens.tolist() == [9, SEQ_LEN_FILL_VALUE, SEQ_LEN_FILL_VALUE]
    assert padded.seq_lens_sum == 9 + 2 * SEQ_LEN_FILL_VALUE
    assert padded.extend_seq_lens.tolist() == [3, 3, 3] and padded.extend_start_loc.tolist() == [0, 3, 6]
    assert padded.extend_seq_lens_cpu == [3, 3, 3]
    assert padded.spec_info.num_correct_drafts.tolist() == [1, 2, 2]  # a padded lane selects its own last token
    assert padded.spec_info.num_accept_tokens.tolist() == [2, 3, 3]
    assert padded.spec_info.hidden_states.shape == (9, ModelConfig().hidden_size)
    assert padded.spec_info.hidden_states[3:].abs().sum() == 0
    assert padded.global_num_tokens_cpu == [9, 9] and padded.global_num_tokens_gpu.tolist() == [9, 9]
    assert padded.global_num_tokens_for_logprob_cpu == [3, 9], "padded rows never reach lm_head: the real counts stay"
    assert padded.num_token_non_padded == 3
    assert fb.batch_size == 1 and fb.num_tokens == 3, "the scheduler's batch is left as it was"


def test_idle_rank_runs_whole_padding_lanes():
    w, fb = draft_batch(MLP_DP2, 0, [0, 2], tp_rank=2)
    padded, pad = mlp_sync.prepare_mlp_sync_batch(fb, MLP_DP2, [0, 6], 3)
    assert pad.original_batch_size == 0 and padded.batch_size == 2 and padded.num_tokens == 6
    assert padded.req_pool_indices.tolist() == [PADDING_ROW] * 2 and padded.extend_start_loc.tolist() == [0, 3]


def test_no_padding_at_the_maximum_or_without_dp_attention():
    _, fb = draft_batch(MLP_DP2, 3, [3, 1])
    assert mlp_sync.prepare_mlp_sync_batch(fb, MLP_DP2, [9, 3], 3) == (fb, None)
    _, fb = draft_batch(PL(4), 1, [1])
    assert mlp_sync.prepare_mlp_sync_batch(fb, PL(4), [3], 3) == (fb, None)


def test_extend_pass_padded_with_one_lane_of_the_missing_tokens():
    """The target's EXTEND lanes have any length: the padding is one lane on the padding row, at position 0."""
    ctx = RankContext(MLP_DP2, 0, comm=None)
    fb = extend_batch(ctx, [Lane(4, 0, [11, 12]), Lane(6, 3, [13])], [3, 8], torch.device("cpu"))
    padded, pad = mlp_sync.prepare_mlp_sync_batch(fb, MLP_DP2, [3, 8], None)
    assert pad == mlp_sync.MlpSyncPadding(2, 3)
    assert padded.batch_size == 3 and padded.input_ids.tolist() == [11, 12, 13, 0, 0, 0, 0, 0]
    assert padded.positions.tolist() == [0, 1, 3] + [0] * 5
    assert padded.req_pool_indices.tolist() == [4, 6, PADDING_ROW] and padded.seq_lens.tolist() == [2, 4, SEQ_LEN_FILL_VALUE]
    assert padded.extend_seq_lens.tolist() == [2, 1, 5] and padded.extend_start_loc.tolist() == [0, 2, 3]
    assert padded.extend_seq_lens_cpu == [2, 1, 5]


def test_unpad_keeps_the_first_rows():
    pad = mlp_sync.MlpSyncPadding(original_batch_size=1, original_num_tokens=2)
    (tok,), (lane,) = mlp_sync.post_forward_mlp_sync_batch(pad, (torch.arange(6),), (torch.arange(3),))
    assert tok.tolist() == [0, 1] and lane.tolist() == [0]
    (same,), _ = mlp_sync.post_forward_mlp_sync_batch(None, (torch.arange(6),))
    assert same.tolist() == list(range(6))


def _count_paddings():
    real = mlp_sync.prepare_mlp_sync_batch
    seen = []

    def spy(fb, layout, dp_tokens, lane_len, *pad_row):
        padded, pad = real(fb, layout, dp_tokens, lane_len, *pad_row)
        seen.append(pad)
        return padded, pad

    return seen, mock.patch.object(mlp_sync, "prepare_mlp_sync_batch", spy)


def test_idle_rank_case_pads_and_padding_is_invisible_to_real_rows():
    """The shipped idle-rank case exercises the padding (idle and short ranks), and eager (padded) still
    matches the graph and TP1 (P3, P4): the padded lanes change no real row."""
    seen, spy = _count_paddings()
    with spy:
        rep = check_case(load_case("tp4_dp2_mlp_idle_rank"))
    assert rep.ok, {k: v.report() for k, v in rep.verdicts.items()}
    padded = [p for p in seen if p is not None]
    assert padded and any(p.original_batch_size == 0 for p in padded), "an idle rank padded"
    assert any(p.original_batch_size > 0 for p in padded), "a short rank padded"


def test_unpad_of_the_wrong_rows_is_caught():
    with mutants.get("dp-unpad-last-rows").planted():
        rep = check_case(load_case("tp4_dp2_mlp_idle_rank"))
    assert not rep.verdicts["P3"]


def test_padded_lane_on_a_live_request_row_is_caught():
    with mutants.get("dp-pad-live-request-row").planted():
        rep = check_case(load_case("tp4_dp2_mlp_idle_rank"))
    assert not rep.verdicts["P3"]


def test_verify_batch_padded_in_whole_trees_with_chain_masks():
    """DP rank 0 verifies 1 tree of T = 3, rank 1 three: rank 0 runs 3 trees, two of them padding, each with the chain mask."""
    ctx = RankContext(MLP_DP2, 0, comm=None)
    fb = extend_batch(ctx, [Lane(5, 4, [11, 12, 13], parents=[-1, 0, 0])], [3, 9], torch.device("cpu"))
    padded, pad = mlp_sync.prepare_mlp_sync_batch(fb, MLP_DP2, [3, 9], None)
    assert pad == mlp_sync.MlpSyncPadding(1, 3)
    assert padded.batch_size == 3 and padded.extend_seq_lens.tolist() == [3, 3, 3] and padded.extend_start_loc.tolist() == [0, 3, 6]
    masks = padded.spec_info.custom_mask.int().tolist()
    assert masks[0] == [[1, 0, 0], [1, 1, 0], [1, 0, 1]], "the real tree: both children see the root, not each other"
    assert masks[1] == masks[2] == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_batch_without_gathered_counts_is_not_padded():
    """The neither branch (attn-DP 4, dp-lm-head, no gathered buffer): every DP rank runs its own MLP on its own tokens."""
    layout = load_case("tp4_dp4_neither").layout
    fb = extend_batch(RankContext(layout, 0, comm=None), [Lane(4, 0, [11, 12])], [2, 5, 1, 3], torch.device("cpu"))
    assert fb.global_num_tokens_cpu is None
    assert mlp_sync.prepare_mlp_sync_batch(fb, layout, [2, 5, 1, 3], None) == (fb, None)


def test_padding_without_gathered_counts_is_caught():
    """The padded rows reach lm_head (P1/I2 counts them), which is how the guard was found."""
    with mutants.get("dp-pad-without-gathered-counts").planted():
        rep = check_case(load_case("tp4_dp4_neither"))
    f = rep.verdicts["P1"].failures
    assert f and f[0].check == "I2", rep.verdicts["P1"].report()


def test_verify_padding_in_token_lanes_is_caught():
    """A padded lane of 2 * T tokens has mask rows for T of them: the loop's eager verify fails on the first short rank."""
    with mutants.get("dp-verify-pad-token-lanes").planted():
        out = check_spec_case(load_case("tp2_dp2_mlp_tp_gather"), runners=("eager",))
    assert not out["run"] and "IndexError" in out["run"].failures[0].message(), out["run"].report()
