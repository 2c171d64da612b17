"""The overlap scheduler (runners.overlap): the future map's ring and placeholders by hand, the device's chain acceptance,
the host one iteration behind, the same tokens as without overlap, and the case's checks catching its mutants."""
import dataclasses

import pytest
import torch

from harness import mutants
from harness.cases.case import CaseError, load_case, parse_case
from harness.pipeline.check import check_case
from harness.props.p8 import CHURN_SCRIPT, CHURN_SPEC, run_churn_script
from harness.run.loop import SpecSession, Workload, request_prompt, run_workload
from runners.config import SpecConfig
from runners.overlap import FutureMap, chain_accept
from runners.parallel.layout import ParallelLayout as PL

SPEC = SpecConfig(num_steps=3, capture_bs=(1, 2, 4), max_running_requests=4, overlap_schedule=True)  # T = 4


def test_future_slots_start_at_one_and_two_launches_in_a_row_never_share_one():
    fm = FutureMap(max_running_requests=4, T=4, device=torch.device("cpu"))
    assert fm.future_limit == 12 and fm.lane_tokens.shape == (20, 4)
    got, prev = [], None
    for bs in (4, 4, 3, 4, 4, 2, 4):
        fi = fm.alloc_future_indices(bs)
        got.append(fi.indices.tolist())
        assert fi.indices.tolist() == list(range(fi.interval.start, fi.interval.stop))
        assert prev is None or not set(prev) & set(got[-1])  # a slot lives until the launch after the next
        prev = got[-1]
    assert got[:4] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15]]  # ct: 0, 4, 8, 11; slot 0 never
    assert got[4] == [4, 5, 6, 7]  # ct = 15 % 12 = 3


def test_placeholders_resolve_on_the_device_against_their_slot():
    fm = FutureMap(max_running_requests=2, T=3, device=torch.device("cpu"))
    fm.lane_tokens[4] = torch.tensor([40, 41, 42])
    fm.lane_tokens[5] = torch.tensor([50, 51, 52])
    fm.new_seq_lens[5] = 17
    ids = torch.tensor([7, 8, 9, -5, -5, -5, -4, -4, -4])  # a lane the host knows, then two the launch before made
    assert fm.resolve_future(ids).tolist() == [7, 8, 9, 50, 51, 52, 40, 41, 42]
    assert fm.resolve_seq_lens(torch.tensor([0, 5]), torch.tensor([11, 0])).tolist() == [11, 17]


def test_the_device_accepts_the_leading_drafts_that_match():
    lanes = torch.tensor([[1, 5, 6, 7], [1, 5, 6, 7], [1, 9, 6, 7], [1, 5, 9, 7]])
    argmax = torch.tensor([[5, 6, 7, 8], [5, 6, 1, 1], [5, 6, 7, 8], [5, 6, 7, 8]])
    assert chain_accept(lanes, argmax).tolist() == [4, 3, 1, 2]  # as runners.verify.accept on the same chains, by hand


def _one_request(overlap: bool) -> SpecSession:
    s = SpecSession(PL(), SpecConfig(num_steps=3, capture_bs=(1, 2, 4), max_running_requests=4, overlap_schedule=overlap))
    prompt, max_new = request_prompt(0, 0, s.model.vocab_size)
    s.step([("add", 0, prompt, max_new, 0)])
    return s


def test_the_host_reads_an_iteration_only_after_launching_the_next():
    on, off = _one_request(True), _one_request(False)
    r_on, r_off = on.requests()[0], off.requests()[0]
    assert r_off.accept_lens and not r_on.accept_lens  # prefilled and verified in step 0; with overlap, not read yet
    assert len(r_on.tokens) == len(r_on.prompt) + 1  # the prefill's token alone
    on.step()
    assert r_on.accept_lens == r_off.accept_lens[:1]


def test_overlap_commits_the_tokens_it_commits_without_overlap():
    """The overlap case's workload with and without overlap, run until every request is done: each request that ran to
    its token budget committed the same tokens, round for round the same accept lengths unless it was preempted."""
    case = load_case("tp2_dp2_overlap")
    out = {}
    for overlap in (True, False):
        spec = SpecConfig(**{**case.scenario.spec.__dict__, "overlap_schedule": overlap})
        s = run_workload(SpecSession(case.layout, spec, case.scenario.model), Workload.from_case(case))
        while any(s.running(d) for d in range(case.layout.attn_dp_size)):
            s.step()
        s.step()  # the last launch is processed in the step after it
        out[overlap] = {rid: r for rid, r in s.requests().items() if r.num_generated == r.max_new_tokens}
    common = sorted(set(out[True]) & set(out[False]))
    assert len(common) >= 6, common
    for rid in common:
        a, b = out[True][rid], out[False][rid]
        assert a.tokens == b.tokens, rid
        if not a.preemptions and not b.preemptions:
            assert a.accept_lens == b.accept_lens, rid


def test_harness_check_catches_a_future_slot_reused_an_iteration_early():
    with mutants.get("overlap-future-slot-reused-early").planted():
        rep = check_case(load_case("tp2_dp2_overlap"), props=("P5",))
    assert not rep.verdicts["P5"].ok and "differs from target-only greedy" in rep.verdicts["P5"].first()


def test_what_overlap_does_not_combine_with_is_refused():
    with pytest.raises(ValueError, match="overlap_schedule: false unless topk = 1"):
        SpecConfig(num_steps=2, topk=2, overlap_schedule=True)
    with pytest.raises(ValueError, match="not combined"):
        SpecConfig(overlap_schedule=True, dp_spec_prefill_coordination=True)
    s = SpecSession(PL(), SPEC)
    with pytest.raises(Exception, match="no logprobs"):
        s.step([("add", 0, (1, 2, 3), 4, 0, True, 0)])
    data = {"name": "x", "description": "d", "layout": {"tp_size": 1}, "spec": {"topk": 2, "overlap_schedule": True}, "schedule": {"batches": [[1]]}}
    with pytest.raises(CaseError, match="spec.overlap_schedule: expected false unless topk = 1"):
        parse_case(data, "x.toml")


def test_batch_churn_with_overlap_keeps_eager_and_graph_together():
    """P8's fixed churn script (bucket boundaries crossed both ways, a preemption) with the overlap scheduler on: eager and
    graph engines agree step by step, the KV books stay consistent, the tokens are target greedy's."""
    out = run_churn_script(PL(), CHURN_SCRIPT, dataclasses.replace(CHURN_SPEC, overlap_schedule=True))
    assert out["P8"].ok and out["P8"].checked > 500, out["P8"].report()
