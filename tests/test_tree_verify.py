"""Tree verify by hand: the tree of a proposal, depths, masks, acceptance and KV moves of tiny
trees written out; the attention backends' tree mask and the node slots on a hand-built batch;
a tree node's logits against the chain of its path; the TARGET_VERIFY graph over trees."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from harness import mutants
from harness.cases.case import load_case  # noqa: E402
from harness.props.p2 import check_padded_lanes  # noqa: E402
from harness.props.p5 import check_lossless, check_spec_case  # noqa: E402
from harness.ranks.simulated import RankFailure, SimulatedWorld  # noqa: E402
from harness.run import loop  # noqa: E402
from harness.run.observe import RunnerObserver  # noqa: E402
from runners.attention import BACKENDS  # noqa: E402
from runners.attention.kinds import TREE_MASK_UNSUPPORTED  # noqa: E402
from runners.config import ModelConfig, SpecConfig  # noqa: E402
from runners.decode_cuda_graph_runner import DecodeCudaGraphRunner, verify_inputs  # noqa: E402
from runners.graph.backend import GraphBackend  # noqa: E402
from runners.memory import PADDING_SLOT, ReqToTokenPool  # noqa: E402
from runners.parallel.dp_attention import RankContext  # noqa: E402
from runners.parallel.layout import ParallelLayout  # noqa: E402
from runners.scheduler import Proposal  # noqa: E402
from runners.spec_decode import loop_unsupported_reason  # noqa: E402
from runners.target import Lane, TargetRunner, extend_batch, target_step  # noqa: E402
from runners.verify import DraftTree, accept, accept_path, kv_moves, tree_depths, tree_mask, tree_of  # noqa: E402

# x = 1 (root); chain d1=5, d2=6, d3=7; top-2 siblings 50 (depth 1), 60 (depth 2), 70 (depth 3)
PROPOSAL = Proposal([5, 6, 7], [[5, 50], [6, 60], [7, 70]])
# lane nodes:       0  1  2  3  4   5
LANE_TOKENS = [1, 5, 6, 7, 50, 60]
LANE_PARENTS = [-1, 0, 1, 2, 0, 1]
T = len(LANE_TOKENS)


# ---------------------------------------------------------------- the tree, by hand


def test_tree_of_a_proposal_is_the_chain_then_the_siblings_by_depth():
    t = tree_of(PROPOSAL, 5)
    assert t.tokens == (5, 6, 7, 50, 60) and t.parents == (-1, 0, 1, -1, 0)
    assert t.top1 == (True, True, True, False, False)
    assert t.lane(1) == (LANE_TOKENS, LANE_PARENTS)
    assert tree_of(PROPOSAL, 2).tokens == (5, 6)  # cut: a chain prefix
    assert tree_of(PROPOSAL, 5, siblings=False).tokens == (5, 6, 7)
    full = tree_of(PROPOSAL, 9)
    assert full.tokens == (5, 6, 7, 50, 60, 70) and full.parents == (-1, 0, 1, -1, 0, 1)


def test_a_draft_tree_needs_earlier_parents():
    with pytest.raises(ValueError, match="parent"):
        DraftTree((1, 2), (-1, 1))


def test_depths_and_mask_by_hand():
    assert tree_depths(LANE_PARENTS) == [0, 1, 2, 3, 1, 2]
    want = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 0, 0, 0, 1, 0],  # sibling 50: the root and itself, not d1 (its sibling)
        [1, 1, 0, 0, 0, 1],  # sibling 60: root, d1, itself, not d2
    ], dtype=torch.bool)
    assert torch.equal(tree_mask(LANE_PARENTS), want)


@pytest.mark.parametrize("argmax,path,new", [
    ([5, 6, 7, 8, 0, 0], [0, 1, 2, 3], [5, 6, 7, 8]),  # the whole chain and the bonus
    ([5, 60, 0, 0, 0, 9], [0, 1, 5], [5, 60, 9]),  # d1, then sibling 60 at depth 2, its bonus 9
    ([50, 0, 0, 0, 3, 0], [0, 4], [50, 3]),  # sibling 50 at depth 1 (a leaf): its bonus 3
    ([9, 6, 7, 8, 0, 0], [0], [9]),  # nothing: later matches count for nothing
])
def test_greedy_acceptance_walks_the_tree(argmax, path, new):
    assert accept_path(LANE_PARENTS, LANE_TOKENS, argmax) == path
    (a,) = accept([LANE_TOKENS], [LANE_PARENTS], torch.tensor([argmax]), [[True, True, True, False, False]])
    assert (a.accept_len, a.new_tokens, a.path) == (len(path), new, path)
    assert a.off_chain == any(i >= 4 for i in path)


def test_kv_moves_take_accepted_nodes_to_their_depth():
    assert kv_moves([0, 1, 2, 3]) == []
    assert kv_moves([0, 1, 5]) == [(5, 2)]
    assert kv_moves([0, 4]) == [(4, 1)]


def test_the_loop_supports_trees_of_any_size_up_to_the_draft():
    assert loop_unsupported_reason(SpecConfig(num_steps=3, topk=2, num_draft_tokens=5)) is None
    assert loop_unsupported_reason(SpecConfig(num_steps=3, topk=2, num_draft_tokens=7)) is None
    assert loop_unsupported_reason(SpecConfig(num_steps=3, topk=3, num_draft_tokens=7, page_size=4)) is None
    assert "at most" in loop_unsupported_reason(SpecConfig(num_steps=3, topk=2, num_draft_tokens=8))
    assert "topk 1" in loop_unsupported_reason(SpecConfig(num_steps=3, topk=1, num_draft_tokens=5))


# ---------------------------------------------------------------- the batch and the backends

CFG = ModelConfig()
CPU = torch.device("cpu")
GPU_OR_CPU = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_ON_CPU = "triton" in BACKENDS and not torch.cuda.is_available()  # the loop's sessions run on CPU tensors
ROOT = 3  # the root's position: a prefix of 3 tokens


def runner(backend="torch", page_size=1, comm=None, device=CPU):
    ctx = RankContext(ParallelLayout(), 0, comm=comm)
    rp = ReqToTokenPool(4, CFG.max_context_len, device)
    t = TargetRunner(ctx, CFG, rp, 64, device, backend, page_size)
    row = rp.alloc()
    rp.req_to_token[row, : ROOT + T] = torch.arange(10, 10 + ROOT + T)  # position p -> slot 10 + p
    return t, row


def test_tree_batch_positions_slots_and_key_mask_by_hand():
    t, row = runner()
    fb = extend_batch(t.ctx, [Lane(row, ROOT, LANE_TOKENS, LANE_PARENTS)], [T], torch.device("cpu"))
    assert fb.forward_mode.is_target_verify() and fb.positions.tolist() == [3, 4, 5, 6, 4, 5]  # root + depth
    target_step(t, fb)
    assert fb.out_cache_loc.tolist() == [13, 14, 15, 16, 17, 18]  # slot of column root + node index
    meta = t.attn.init_forward_metadata(fb)
    seen = [meta.key_mask[i].nonzero().flatten().tolist() for i in range(T)]
    assert seen == [[0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 7], [0, 1, 2, 3, 4, 8]]


def _node_vs_chain(backend, device=CPU):
    """Node 5 (sibling 60 under d1) must compute what the chain [x, d1, 60] computes at its last token."""
    t, row = runner(backend, device=device)
    prefix = Lane(row, 0, [7, 8, 9])
    t.forward_synced([prefix], [3])
    tree = t.forward_synced([Lane(row, ROOT, LANE_TOKENS, LANE_PARENTS)], [T])
    t2, row2 = runner(backend, device=device)
    t2.forward_synced([Lane(row2, 0, [7, 8, 9])], [3])
    chain = t2.forward_synced([Lane(row2, ROOT, [1, 5, 60])], [3])
    return tree.logits[5], chain.logits[2], tree.logits[4], chain


def test_a_tree_node_computes_the_chain_of_its_path():
    node, path_end, sibling, _ = _node_vs_chain("torch")
    torch.testing.assert_close(node, path_end, rtol=1e-5, atol=1e-5)  # fp32: the same sums over other key counts
    assert not torch.allclose(node, sibling, rtol=1e-3, atol=1e-3)  # another node sees another context


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton is not installed")
def test_triton_applies_the_tree_mask():
    """In the interpreter on CPU; compiled on a GPU machine."""
    t_node, t_chain, _, _ = _node_vs_chain("triton", GPU_OR_CPU)
    r_node, _, _, _ = _node_vs_chain("torch", GPU_OR_CPU)
    torch.testing.assert_close(t_node, t_chain, rtol=1e-4, atol=1e-4)  # interpreter fp32 vs reference: summation order
    torch.testing.assert_close(t_node, r_node, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif("flashinfer" not in BACKENDS, reason="flashinfer needs a CUDA GPU and the gpu extra")
def test_flashinfer_refuses_a_tree_batch_with_the_reason():
    t, row = runner("flashinfer", device=GPU_OR_CPU)
    fb = extend_batch(t.ctx, [Lane(row, ROOT, LANE_TOKENS, LANE_PARENTS)], [T], GPU_OR_CPU)
    with pytest.raises(NotImplementedError, match="tree mask"):
        t.attn.init_forward_metadata(fb)


# ---------------------------------------------------------------- the graph runner over trees


def test_verify_graph_runs_trees_and_resets_padded_masks():
    SimulatedWorld(ParallelLayout()).run(_graph_over_trees)


def _graph_over_trees(comm):
    spec = SpecConfig(num_steps=3, topk=2, num_draft_tokens=T, capture_bs=(1, 2, 4), max_running_requests=4)
    t, row = runner(comm=comm)
    t.forward_synced([Lane(row, 0, [7, 8, 9])], [3])
    g = DecodeCudaGraphRunner(t.ctx, CFG, spec, t, GraphBackend("sim"))
    observer = RunnerObserver(g).attach()
    g.capture()
    lanes = [Lane(row, ROOT, LANE_TOKENS, LANE_PARENTS)]
    g.custom_mask.fill_(False)  # as if a larger batch of other trees had left its masks
    out = g.replay(verify_inputs(lanes, [1], torch.device("cpu")))
    assert observer.replays[-1].bs == 1 and torch.equal(g.custom_mask[0], tree_mask(LANE_PARENTS))
    ref = t.forward_synced(lanes, [T])
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)  # the same body; GEMM blocking of a padded M
    g.custom_mask[3].fill_(False)  # a stale mask that hides even the root
    lanes3 = [Lane(row, ROOT, LANE_TOKENS, LANE_PARENTS)] * 3
    g.replay(verify_inputs(lanes3, [3], torch.device("cpu")))
    assert observer.replays[-1].bs == 4
    chain = torch.ones(T, T, dtype=torch.bool).tril()
    assert torch.equal(g.custom_mask[3], chain)  # the padded lane: the canonical chain mask
    assert g.out_cache_loc[3 * T :].tolist() == [PADDING_SLOT] * T  # its KV goes to the padding slot


# ---------------------------------------------------------------- the mutants, and what kills them

TREE_CASE = "tp2_page4_tree"


@pytest.mark.parametrize("mutant,check", [
    ("verify-tree-mask-sees-siblings", "tree-vs-chain"),
    ("verify-tree-sibling-position-off-by-one", "tree-vs-chain"),
    ("verify-node-kv-at-position", "tree-vs-chain"),
    ("verify-accepted-kv-not-moved", "lossless"),  # the verify pass is right; the next round reads the wrong KV
])
def test_p5_kills_the_tree_verify_mutants(mutant, check):
    with mutants.get(mutant).planted():
        v = check_spec_case(load_case(TREE_CASE), runners=("graph",))
    assert not v["P5"], mutant
    assert v["P5"].failures[0].check == check, v["P5"].report()


def test_p2_kills_a_stale_padded_tree_mask():
    with mutants.get("verify-stale-padded-mask").planted():
        v = check_padded_lanes(load_case(TREE_CASE))["P2"]
    f = v.failures[0]
    assert (f.check, f.field, f.where["runner"]) == ("canonical", "custom_mask", "target_verify") and f.where["lane"] >= f.where["raw_bs"]


def test_p2_poisons_the_verify_runner_and_passes_on_the_tree_case():
    v = check_padded_lanes(load_case(TREE_CASE))["P2"]
    assert v, v.report()


# ---------------------------------------------------------------- the case's attention backend


def _with_backend(name: str, backend: str):
    case = load_case(name)
    return dataclasses.replace(case, scenario=dataclasses.replace(case.scenario, attention_backend=backend))


class _Built(Exception):
    pass


def test_the_loop_properties_run_the_cases_backend():
    seen = []

    def hook(engine):
        seen.append((engine.target.attn.name, engine.draft.worker.attn.name))
        raise _Built  # the engine is built: that is all this test needs

    want = "triton" if TRITON_ON_CPU else "torch"
    # the eager session: case_session hands the case's backend to SpecSession whatever the runner, and a graph engine
    # would capture its graphs (interpreted Triton) before the hook sees it; test_p5_with_the_triton_backend_on_a_tree
    # builds and runs a graph session on triton
    with pytest.raises(RankFailure, match="_Built"):
        loop.case_session(_with_backend("tp1_neither", want), "eager", hook=hook)
    assert seen == [(want, want)]


def test_flashinfer_cases_skip_the_loop_properties_with_the_reason():
    assert loop.spec_skip_reason(_with_backend("tp1_neither", "flashinfer")) == TREE_MASK_UNSUPPORTED
    assert loop.spec_skip_reason(load_case(TREE_CASE)) is None


@pytest.mark.skipif(not TRITON_ON_CPU, reason="needs triton's interpreter on CPU (the sessions run on CPU tensors)")
def test_p5_with_the_triton_backend_on_a_tree():
    spec = SpecConfig(num_steps=2, topk=2, num_draft_tokens=4, capture_bs=(1, 2), max_running_requests=2)
    s = loop.run_workload(loop.SpecSession(ParallelLayout(), spec, runner="graph", attention_backend="triton"),
                                 loop.Workload(((2,),), rounds_per_phase=2, preempt=False))
    assert s.engines[0].target.attn.name == "triton"
    v = check_lossless(s, {})
    assert v and v.checked >= 2, v.report()
