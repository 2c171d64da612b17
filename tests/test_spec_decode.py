"""The speculative decoding loop: greedy verify by hand, KV bookkeeping, P5 lossless on every
branch and runner, the agreeing draft, P6 acceptance goldens, and the mutants P5 and P6 kill."""
import json

import pytest
import torch

from harness import mutants
from harness.cases.case import load_case
from harness.golden import GoldenError
from harness.golden import acceptance as acceptance_golden
from harness.golden.acceptance import GOLDEN_CASES, AcceptanceGoldenError, load_acceptance_golden
from harness.props.p5 import check_agreeing_draft, check_lossless, check_spec_case
from harness.run import loop
from harness.run.loop import (
    SpecSession,
    Workload,
    acceptance_stats,
    position_accepts,
    run_workload,
)
from runners.config import SpecConfig
from runners.memory import ReqToTokenPool
from runners.parallel.layout import ParallelLayout as PL
from runners.scheduler import KVBook, Proposal, Request
from runners.verify import accept, tree_of

SPEC = SpecConfig(num_steps=3, topk=1, capture_bs=(1, 2, 4, 8), max_running_requests=8)  # T = 4
SPEC_TOPK2 = SpecConfig(num_steps=2, topk=2, capture_bs=(1, 2, 4, 8), max_running_requests=8)  # a tree of 3 tokens: the chain
SPEC_TREE = SpecConfig(num_steps=2, topk=2, num_draft_tokens=5, capture_bs=(1, 2, 4, 8), max_running_requests=8)  # chain + 2 siblings
SMALL = Workload(((3,), (5,), (2,)), rounds_per_phase=2)
SMALL_DP2 = Workload(((2, 1), (0, 3), (1, 1)), rounds_per_phase=2)  # each group idle once
BRANCH_LAYOUTS = [
    PL(),  # neither, TP1
    PL(2, moe_dense_tp_size=1),  # attn-TP gather (the seed bug's branch)
    PL(2, 2, True),  # MLP-TP gather, DP2, logits DP gather
    PL(4, 2, True, 1, True, "deepep"),  # attn-TP gather inside DP groups
    PL(2, 2, True, enable_dp_lm_head=True),  # MLP-TP gather, dp lm_head
]


# ---------------------------------------------------------------- verify, by hand


def test_chain_acceptance_counts_the_leading_matches():
    chain = [-1, 0, 1, 2]
    drafts = [[1, 5, 6, 7], [1, 5, 6, 7], [1, 9, 6, 7], [1, 5, 9, 7]]
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 1, 1], [5, 6, 7, 8], [5, 6, 7, 8]])  # argmax after x, d1, d2, d3
    assert [a.accept_len for a in accept(drafts, [chain] * 4, target)] == [4, 3, 1, 2]  # a later match after a miss counts for nothing


def test_accept_commits_target_argmaxes_and_takes_a_matching_sibling():
    tree = tree_of(Proposal([5, 6], [[5, 50], [6, 60]]), 4)  # lane: x, d1=5, d2=6, 50 (depth 1), 60 (depth 2, under d1)
    tokens, parents = tree.lane(1)
    assert (tokens, parents) == ([1, 5, 6, 50, 60], [-1, 0, 1, 0, 1])
    target = torch.tensor([[5, 60, 0, 0, 101], [50, 0, 0, 102, 0], [1, 2, 3, 4, 5]])  # argmax after each node
    a = accept([tokens] * 3, [parents] * 3, target, [tree.top1] * 3)
    assert (a[0].accept_len, a[0].new_tokens, a[0].path, a[0].off_chain) == (3, [5, 60, 101], [0, 1, 4], True)  # d1, sibling 60, its bonus
    assert (a[1].accept_len, a[1].new_tokens, a[1].path, a[1].off_chain) == (2, [50, 102], [0, 3], True)  # sibling at depth 1
    assert (a[2].accept_len, a[2].new_tokens, a[2].off_chain) == (1, [1], False)  # nothing: the bonus only
    chain = tree_of(Proposal([5, 6], [[5, 50], [6, 60]]), 2).lane(1)  # no siblings in a tree of 3 tokens
    assert [x.accept_len for x in accept([chain[0]] * 3, [chain[1]] * 3, target[:, :3])] == [2, 1, 1]


def test_position_accepts():
    assert position_accepts([1, 4, 2, 3], 3) == [3, 2, 1]


# ---------------------------------------------------------------- KV bookkeeping


def _book(slots=16, rows=4):
    return KVBook(ReqToTokenPool(rows, 12, torch.device("cpu")), slots)


def test_kv_book_reuses_the_most_recently_freed_slot_and_never_the_padding_slot():
    book = _book()
    a, b = Request(0, (1, 2), 4), Request(1, (3,), 4)
    for r in (a, b):
        book.admit(r)
    book.ensure(a, 5)
    book.ensure(b, 3)
    assert 0 not in a.slots + b.slots and not book.problems([a, b])
    freed = a.slots[3:]
    book.truncate(a, 3)
    book.ensure(b, 5)
    assert b.slots[3:] == freed  # a stack: the slots just freed go to the next request at once (in their order)
    assert book.req_pool.req_to_token[b.req_pool_idx, :5].tolist() == b.slots
    book.release(a)
    assert not book.problems([b])


def test_kv_book_problems_name_double_ownership_and_leaks():
    book = _book()
    a, b = Request(0, (1,), 4), Request(1, (2,), 4)
    for r in (a, b):
        book.admit(r)
        book.ensure(r, 3)
    b.slots[1] = a.slots[0]
    book.req_pool.req_to_token[b.req_pool_idx, 1] = a.slots[0]
    probs = book.problems([a, b])
    assert any(f"slot {a.slots[0]} owned by requests 0 and 1" in p for p in probs)
    assert any("slot leak" in p for p in probs)


# ---------------------------------------------------------------- P5


@pytest.mark.parametrize("runner", ["eager", "graph"])
@pytest.mark.parametrize("layout", BRANCH_LAYOUTS, ids=lambda x: x.describe())
def test_p5_lossless_on_every_branch(layout, runner):
    s = run_workload(SpecSession(layout, SPEC, runner=runner), SMALL_DP2 if layout.attn_dp_size > 1 else SMALL)
    v = check_lossless(s, {"layout": layout.describe(), "runner": runner})
    assert v, v.report()
    assert sum(len(r.accept_lens) for r in s.requests().values()) > 10
    if runner == "graph":
        assert sum(e.draft.driver.stats.replays for e in s.engines) > 0


@pytest.mark.parametrize("layout", [PL(), PL(4, moe_dense_tp_size=1)], ids=lambda x: x.describe())
def test_p5_lossless_with_a_tree(layout):
    s = run_workload(SpecSession(layout, SPEC_TREE, runner="graph"), SMALL)
    v = check_lossless(s, {"layout": layout.describe()})
    assert v, v.report()
    assert sum(sum(r.sibling_accepts) for r in s.requests().values()) > 0  # the tree accepted a sibling at least once


@pytest.mark.parametrize("layout,spec,wl", [(PL(), SPEC, SMALL), (PL(2), SPEC_TOPK2, SMALL), (PL(2), SPEC_TREE, SMALL),
                                             (PL(2, 2, True), SPEC, SMALL_DP2)], ids=["tp1", "tp2-topk2", "tp2-tree", "tp2-dp2-mlp"])
def test_p5_a_draft_equal_to_the_target_accepts_everything(layout, spec, wl):
    v = check_agreeing_draft(layout, spec, wl)
    assert set(v) == {"P5"} and v["P5"], v["P5"].report()
    s = run_workload(SpecSession(layout, spec, proposer="target"), wl)
    lens = [a for r in s.requests().values() for a in r.accept_lens]
    assert lens and set(lens) == {spec.num_steps + 1}  # the whole chain and the bonus, every round


def test_p5_kills_acceptance_per_request():
    with mutants.get("accept-per-request").planted():
        v = check_spec_case(load_case("tp1_neither"), runners=("eager",))
    assert not v["P5"]
    f = v["P5"].failures[0]
    assert f.check == "lossless" and "differs from target-only greedy" in f.detail and "request" in f.where
    assert not v["P6"]  # and acceptance drifts (more is accepted than is right)


def test_p5_kills_a_broken_mlp_gather_that_the_target_uses():
    with mutants.get("dp-scatter-wrong-chunk").planted():
        v = check_agreeing_draft(PL(2, 2, True), SPEC, SMALL_DP2)
    assert not v["P5"] and v["P5"].failures[0].check == "lossless"


# ---------------------------------------------------------------- P6


@pytest.mark.parametrize("name", GOLDEN_CASES)
def test_p6_acceptance_matches_the_golden_eager_and_graph(name):
    v = check_spec_case(load_case(name), runners=("eager", "graph"))
    assert "run" not in v, v["run"].report()
    assert v["P3"], v["P3"].report()  # the graph run replayed every runner, its verify replays matched eager
    assert v["P5"], v["P5"].report()
    assert v["P6"], v["P6"].report()
    assert all(x.ok for x in v.values()), {k: x.report() for k, x in v.items() if not x.ok}  # and what a feature adds (P7)


def test_p6_alone_kills_a_hidden_state_from_the_wrong_step():
    with mutants.get("draft-hidden-next-step").planted():
        v = check_spec_case(load_case("tp1_neither"), runners=("graph",))
    assert v["P5"], v["P5"].report()  # the text is still right ...
    assert not v["P6"]  # ... only acceptance changed
    f = v["P6"].failures[0]
    assert f.field in ("position_accepts", "requests")
    if f.field == "position_accepts":
        assert "draft positions [" in f.detail and "verify round" in f.detail and isinstance(f.where["request"], int)


def test_p6_sees_the_seed_bug_as_acceptance_only():
    case = load_case("tp4_attn_tp_gather")
    golden = load_acceptance_golden(case)
    with mutants.get("sglang-26416").planted():
        s = loop.case_session(case, "graph")
    v = check_lossless(s, {})
    assert v, v.report()  # lossless ...
    got = acceptance_stats(s)["summary"]["mean_accept_len"]
    assert got < golden["summary"]["mean_accept_len"] - 0.2  # ... but the seed bug's logits rows are zero: acceptance collapses


def test_p6_golden_refused_for_another_model(tmp_path, monkeypatch):
    case = load_case("tp1_neither")
    data = json.loads(acceptance_golden.golden_path(case.name).read_text())
    data["fingerprint"] = "0000000000000000"
    (tmp_path / "tp1_neither.json").write_text(json.dumps(data))
    with pytest.raises(AcceptanceGoldenError, match="refused.*fingerprint"):
        load_acceptance_golden(case, accept_dir=tmp_path)
    (tmp_path / "tp1_neither.json").unlink()
    with pytest.raises(AcceptanceGoldenError, match="no acceptance golden.*record it: harness golden record tp1_neither --kind acceptance "
                                                     "--golden-dir"):
        load_acceptance_golden(case, accept_dir=tmp_path)


def test_p6_record_refuses_under_xdist(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    with pytest.raises(GoldenError, match="serially"):
        acceptance_golden.record_acceptance(["tp1_neither"])


def test_goldens_are_consistent():
    for name in GOLDEN_CASES:
        g = json.loads(acceptance_golden.golden_path(name).read_text())
        s = g["summary"]
        assert 1.0 < s["mean_accept_len"] < g["spec"]["num_steps"] + 1 and s["verify_rounds"] >= 20, (name, s)
        assert all(p["position_accepts"] == position_accepts(p["accept_lens"], g["spec"]["num_steps"]) for p in g["requests"].values())
