"""Logprobs through speculative decoding (runners.logprobs): the accepted rows by hand, the host's row per token, the
loop against target-only greedy, the draft passes' reset flag, the case loader, and the case's checks biting."""
import math

import pytest
import torch

from harness import mutants
from harness.cases.case import CaseError, default_cases, load_case, parse_case
from harness.golden.logprobs import LOGPROB_CASES
from harness.pipeline.check import check_case
from harness.props.logprobs import check_draft_passes_replayed, check_logprobs
from harness.run.loop import SpecSession, logprob_params, oracle, request_prompt
from harness.verdict import Verdict
from runners.config import SpecConfig
from runners.logprobs import NO_LOGPROBS, LogprobParams, SpecLogprobs, add_logprob_return_values, compute_spec_logprobs
from runners.parallel.layout import ParallelLayout
from runners.scheduler import Request

LN = math.log


def test_spec_logprobs_read_the_accepted_rows_and_each_requests_top_k():
    # row r's logits ln([1, 1, 2, 4]) rotated by r: probabilities 1/8, 1/8, 1/4, 1/2, so every logprob is known by hand
    base = torch.tensor([LN(1), LN(1), LN(2), LN(4)])
    logits = torch.stack([base.roll(r) for r in range(6)])  # row r: token (3 + r) % 4 has 1/2, (2 + r) % 4 has 1/4
    accept_index = torch.tensor([[0, 2, -1], [4, -1, -1]])  # request 0 accepted rows 0 and 2, request 1 row 4
    accepted_ids = torch.tensor([[3, 0, -1], [0, -1, -1]])
    lp = compute_spec_logprobs(logits, accept_index, accepted_ids, LogprobParams(True, (2, 0)))
    assert lp.max_accept == 3
    torch.testing.assert_close(lp.token_logprobs[0, :2], torch.tensor([LN(1 / 2), LN(1 / 4)]))  # row 2: token 0 has 1/4
    torch.testing.assert_close(lp.token_logprobs[1, 0], torch.tensor(LN(1 / 8)))  # row 4 is row 0 again: token 0 has 1/8
    assert lp.top_idx.tolist()[:3] == [[3, 2], [1, 0], [3, 2]]  # request 0's rows 0, 2 and its padded row (row 0 again)
    torch.testing.assert_close(lp.top_val[1], torch.tensor([LN(1 / 2), LN(1 / 4)]))
    assert lp.top_idx.tolist()[3:] == [[-1, -1]] * 3  # request 1 asked for no top-k: every entry masked
    assert torch.isinf(lp.top_val[3:]).all()


def test_host_appends_token_j_of_request_i_from_row_i_times_max_accept_plus_j():
    A = 3
    token = torch.arange(6, dtype=torch.float32).view(2, A)  # request i, token j -> 3i + j
    top_val = torch.arange(6, dtype=torch.float32)[:, None].repeat(1, 2) * 10  # row r -> [10r, 10r]
    top_idx = torch.arange(6)[:, None].repeat(1, 2)
    asks = Request(0, (1,), 8, return_logprob=True, top_logprobs_num=1)
    silent = Request(1, (1,), 8)
    add_logprob_return_values([asks, silent], [2, 3], SpecLogprobs(token, top_val, top_idx))
    assert asks.output_token_logprobs == [0.0, 1.0]
    assert asks.output_top_logprobs_idx == [[0], [1]] and asks.output_top_logprobs_val == [[0.0], [10.0]]
    assert silent.output_token_logprobs == [] and silent.output_top_logprobs_idx == []
    second = Request(2, (1,), 8, return_logprob=True, top_logprobs_num=2)
    add_logprob_return_values([silent, second], [1, 2], SpecLogprobs(token, top_val, top_idx))
    assert second.output_top_logprobs_idx == [[3, 3], [4, 4]]  # request 1 of the batch: rows 3 and 4


def test_a_batch_returns_logprobs_when_any_request_asks():
    reqs = [Request(0, (1,), 4), Request(1, (1,), 4, return_logprob=True, top_logprobs_num=3), Request(2, (1,), 4, return_logprob=True)]
    assert LogprobParams.of(reqs) == LogprobParams(True, (0, 3, 0))
    assert LogprobParams.of(reqs[:1]) is NO_LOGPROBS
    assert [logprob_params(rid, 2) for rid in range(3)] == [(True, 2), (True, 0), (False, 0)]
    assert logprob_params(0, None) == (False, 0)


def _session(runner: str) -> SpecSession:
    s = SpecSession(ParallelLayout(), SpecConfig(num_steps=2, topk=2, num_draft_tokens=4, capture_bs=(1, 2, 4), max_running_requests=4), runner=runner)
    cmds = []
    for rid in range(3):
        prompt, max_new = request_prompt(1, rid, s.model.vocab_size)
        cmds.append(("add", rid, prompt, max_new, 0, *logprob_params(rid, 3)))
    s.step(cmds)
    for _ in range(5):
        s.step()
    return s


def test_loop_logprobs_are_target_greedys_eager_and_graph():
    for runner in ("eager", "graph"):
        s = _session(runner)
        reqs = s.requests()
        assert sum(len(r.output_token_logprobs) for r in reqs.values()) > 10, "the workload committed tokens with logprobs"
        v = Verdict("P5")
        check_logprobs(v, reqs, oracle(s, sorted(reqs.values(), key=lambda r: r.rid)), "float32", {"runner": runner})
        assert v.checked > 10 and v.ok, v.report()
        if runner == "graph":
            replayed = Verdict("P3")
            check_draft_passes_replayed(replayed, s.engines, 4, {"runner": runner})
            assert replayed.checked == 1 and replayed.ok, replayed.report()  # checked: every batch fits the buckets


def test_a_draft_pass_that_keeps_the_flag_replays_no_graph():
    """Off DP (one group: no desync to kill it first) the draft-extend of every batch that asked falls back to eager: P3."""
    with mutants.get("logprob-flag-not-reset-for-draft").planted():
        s = _session("graph")
    v = Verdict("P3")
    check_draft_passes_replayed(v, s.engines, 4, {"runner": "graph"})
    assert not v.ok and "eager fallbacks" in v.first()


def test_case_file_top_logprobs_num_is_checked_and_feeds_the_workload():
    case = load_case("tp2_dp2_logprobs")
    assert case.top_logprobs_num == 3 and "tp2_dp2_logprobs" in LOGPROB_CASES
    assert all(c.top_logprobs_num is None for c in default_cases() if c.name not in LOGPROB_CASES)
    data = {"name": "x", "description": "d", "layout": {"tp_size": 1}, "schedule": {"batches": [[1]], "top_logprobs_num": 21}}
    with pytest.raises(CaseError, match=r"schedule.top_logprobs_num: expected an integer in 0..20, got 21"):
        parse_case(data, "x.toml")


def test_harness_check_runs_the_logprob_checks_on_the_case():
    """`harness check --props all` on the logprob case: the oracle (P5) and the logprob golden (P6) see a wrong top-k row."""
    with mutants.get("logprob-top-rows-per-request").planted():
        rep = check_case(load_case("tp2_dp2_logprobs"), props=("P5", "P6"))
    assert not rep.verdicts["P5"].ok and "top logprobs" in rep.verdicts["P5"].first()
    assert not rep.verdicts["P6"].ok
