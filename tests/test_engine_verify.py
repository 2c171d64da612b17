"""engine-check on SGLang's target verify graphs (harness/engines/sglang/target_verify.py): bugs planted into the
verify runner of a copy of the newest release are caught, on target_verify lines only; the bucket rule it is held to.

The unmodified release's target_verify lines all pass (tests/test_engine_check.py); a planted line adds failures,
and only there: the draft-extend and draft-decode runners do not use the verify runner's capture or replay fill.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from harness.props.p1_records import verify_capture_bs
from runners.parallel.layout import ParallelLayout
from tests.helpers.engine_releases import installed_release
from tests.test_engine_planted import ATTN_TP, NEWEST, PLAIN, _failures, _plant

VERIFY = "sglang/srt/model_executor/runner/decode_cuda_graph_runner.py"  # DecodeCudaGraphRunner: the target's decode / verify graphs
MLP_TP = "ParallelLayout(4, 2, True)"  # MLP-TP gather: two DP ranks

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def newest() -> Path:
    return installed_release(NEWEST)


def _verify_kinds(fails: list[dict]) -> tuple[set[tuple], set[str]]:
    """(check, field) of the target_verify failures, and every runner that failed (the newest release's own native-twin
    failures excluded: they are the multi-layer NPU path's, tests/test_engine_planted.py NATIVE_TAIL)."""
    mine = {(f["check"], f["field"]) for f in fails if f["runner"] == "target_verify"}
    runners = {f["runner"] for f in fails if f["path"] != "npu"}
    return mine, runners


@pytest.mark.engine
def test_replay_fill_that_stops_resetting_padded_seq_lens_is_caught_on_target_verify_lines(newest, tmp_path):
    # load_batch hands the registry the raw batch as the padded one: the per-request slots' padded lanes are not reset
    target = _plant(newest, tmp_path / "sglang", VERIFY, "            padded_bs=bs,\n", "            padded_bs=raw_bs,\n")
    mine, runners = _verify_kinds(_failures(target, PLAIN, ""))
    assert {("padding", "padded seq_lens"), ("canonical", "seq_lens"), ("canonical", "req_pool_indices")} <= mine, mine
    assert runners == {"target_verify"}, runners


@pytest.mark.engine
def test_replay_fill_padding_index_buffers_with_one_is_caught_by_the_pad_value_only(newest, tmp_path):
    # the registry's ZERO policy writes 1: every replay alike, so the padded lanes are history independent and only
    # the value check sees that padded tokens now write KV slot 1 and read request row 1
    registry = "sglang/srt/model_executor/cuda_graph_buffer_registry.py"
    target = _plant(newest, tmp_path / "sglang", registry, "            tail.zero_()\n", "            tail.fill_(1)\n")
    mine, runners = _verify_kinds(_failures(target, PLAIN, ""))
    assert mine == {("pad value", "out_cache_loc"), ("pad value", "req_pool_indices"), ("pad value", "positions")}, mine
    assert runners == {"target_verify"}, runners  # the registry is the verify runner's alone among those driven


@pytest.mark.engine
def test_capture_that_counts_requests_for_the_gathered_tokens_is_caught_on_target_verify_lines(newest, tmp_path):
    # capture_prepare bakes bs where the verify's tokens are bs * num_draft_tokens (the seed bug's sibling, in verify)
    target = _plant(newest, tmp_path / "sglang", VERIFY, "        global_num_tokens_cpu = self._global_num_tokens_for_graph(num_tokens)\n",
                    "        global_num_tokens_cpu = self._global_num_tokens_for_graph(bs)\n")
    mine, runners = _verify_kinds(_failures(target, f"{ATTN_TP}, {MLP_TP}", ""))
    assert {("I1", "global_num_tokens_gpu"), ("I1", "global_num_tokens_for_logprob_gpu"), ("I5", "global_num_tokens"),
            ("I2", "global_num_tokens_for_logprob_gpu (capture)")} <= mine, mine
    assert runners == {"target_verify"}, runners


@pytest.mark.parametrize(("layout", "pool", "expected"), [
    (ParallelLayout(4), 16, [1, 2, 4, 8, 16]),  # no gathered buffer: base 1
    (ParallelLayout(4, 1, False, 1), 16, [1, 2, 4, 8, 16]),  # attn_tp 4, T 4: every bs * 4 is a multiple of 4
    (ParallelLayout(8, 1, False, 1), 16, [2, 4, 8, 16]),  # attn_tp 8: bs * 4 must be a multiple of 8
    (ParallelLayout(8, 1, False, 1), 6, [2, 4, 8]),  # the pool (6) rounded up to the base (8) is the largest bucket
    (ParallelLayout(4, 1, False, 1, enable_two_batch_overlap=True), 16, [8, 16]),  # TBO: base 8, aligned by requests
])
def test_verify_buckets_are_aligned_by_tokens(layout, pool, expected):
    assert verify_capture_bs(layout, (1, 2, 4, 8, 16), pool, 4) == expected
