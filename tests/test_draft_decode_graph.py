"""The single-layer EAGLE draft decode: tree expansion by hand, EAGLEDraftCudaGraphRunner's capture metadata
and replay fill, eager vs graph, padded lanes, its use by the spec loop, and the mutants its properties kill."""
import pytest
import torch

from harness import mutants
from harness.cases.case import load_case
from harness.props.draft_decode import check_decode_case, check_decode_padded_lanes
from harness.props.p1_metadata import check_decode_metadata
from harness.ranks.simulated import SimulatedWorld
from harness.run.observe import RunnerObserver
from runners.config import ModelConfig, SpecConfig
from runners.draft_extend import DraftWorker
from runners.eagle_draft import (
    DraftDecodeInputs,
    DraftDecodeOutputs,
    run_eager_decode,
    select_top_k_tokens,
    tree_proposals,
)
from runners.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
from runners.graph.backend import GraphBackend
from runners.parallel.dp_attention import RankContext
from runners.parallel.layout import ParallelLayout as PL

MODEL = ModelConfig()


def spec(topk=1, num_steps=3):
    return SpecConfig(num_steps=num_steps, topk=topk, capture_bs=(1, 2, 4), max_running_requests=4, draft="single_layer")


# ---- tree expansion, by hand ----
def test_select_top_k_first_step_keeps_every_candidate():
    p, idx = torch.tensor([[0.6, 0.4]]), torch.tensor([[10, 20]])
    h = torch.tensor([[1.0, 2.0]])
    ids, hid, scores, parents = select_top_k_tokens(0, p, idx, h, None, 2)
    assert ids.tolist() == [10, 20]
    assert hid.tolist() == [[1.0, 2.0], [1.0, 2.0]]
    assert torch.equal(scores, p) and parents.tolist() == [[-1, -1]]


def test_select_top_k_later_step_by_hand():
    # kept lanes 0 (score .6) and 1 (score .4); children of lane 0: 11 (.5), 12 (.3); of lane 1: 21 (.9), 22 (.05)
    # cumulative: 11 -> .30, 12 -> .18, 21 -> .36, 22 -> .02: keep 21 (parent lane 1), then 11 (parent lane 0)
    scores = torch.tensor([[0.6, 0.4]])
    child_p = torch.tensor([[0.5, 0.3], [0.9, 0.05]])
    child_ids = torch.tensor([[11, 12], [21, 22]])
    hidden = torch.tensor([[0.0, 0.0], [7.0, 7.0]])  # lane 0's and lane 1's outputs
    ids, hid, new_scores, parents = select_top_k_tokens(1, child_p, child_ids, hidden, scores, 2)
    assert ids.tolist() == [21, 11]
    assert parents.tolist() == [[1, 0]]
    assert hid.tolist() == [[7.0, 7.0], [0.0, 0.0]]  # each new node carries its parent's hidden state
    assert torch.allclose(new_scores, torch.tensor([[0.36, 0.30]]))


def test_tree_proposals_best_path_and_siblings_by_hand():
    # depth 1: [5, 6]; depth 2 kept: 8 (parent lane 1), 7 (parent lane 0); depth 3 kept: 9 (parent 0), 3 (parent 1), best 3
    # children: depth-1 lane 0 -> [7, 1], lane 1 -> [8, 2]; depth-2 lane 0 (token 8) -> [9, 4], lane 1 (token 7) -> [3, 0]
    z = torch.zeros
    out = DraftDecodeOutputs(
        tokens=torch.tensor([[[5, 6], [8, 7], [9, 3]]]),
        parents=torch.tensor([[[-1, -1], [1, 0], [0, 1]]]),
        scores=torch.tensor([[[0.5, 0.4], [0.3, 0.2], [0.1, 0.15]]]),
        child_index=torch.tensor([[[[7, 1], [8, 2]], [[9, 4], [3, 0]]]]),
        child_p=z(1, 2, 2, 2), step_logits=z(2, 2, 4), logits=z(2, 4), rows_fed=torch.tensor(2),
    )
    (p,) = tree_proposals(torch.tensor([[5, 6]]), out, 3)
    # best leaf 3 (lane 1) <- 7 (lane 1 at depth 2) <- 5 (lane 0 at depth 1)
    assert p.tokens == [5, 7, 3]
    assert p.candidates == [[5, 6], [7, 1], [3, 0]]


# ---- metadata: what get_forward_batch bakes per branch (bs 4, topk 2: 8 lanes), by hand ----
@pytest.mark.parametrize(
    "layout,gnt,buf",
    [(PL(4, 2, True), [8, 8], 16), (PL(4, 2, True, 1, True, "deepep"), [8], 8), (PL(4, moe_dense_tp_size=1), [8], 8), (PL(4), None, None)],
    ids=["mlp", "attn-dp", "attn", "neither"],
)
def test_get_forward_batch_counts_lanes(layout, gnt, buf):
    worker = DraftWorker(RankContext(layout, 0, comm=None), MODEL, spec(topk=2), num_layers=1, build_model=False)
    fb = EAGLEDraftCudaGraphRunner(worker, GraphBackend("sim")).get_forward_batch(4)
    assert fb.forward_mode.name == "DECODE" and fb.batch_size == 4 and fb.num_tokens == 8 and fb.out_cache_loc.shape[0] == 8 * 2
    assert fb.global_num_tokens_cpu == gnt and fb.global_num_tokens_for_logprob_cpu == gnt and fb.global_dp_buffer_len == buf
    if gnt is not None:
        assert fb.global_num_tokens_gpu.tolist() == gnt and fb.global_num_tokens_for_logprob_gpu.tolist() == gnt


def test_capture_equals_replay_on_every_branch():
    sched = [(3, 1), (1, 0), (4, 2)]
    for layout in (PL(4, 2, True), PL(4, 2, True, 1, True, "deepep"), PL(2, moe_dense_tp_size=1), PL(2)):
        dp = layout.attn_dp_size
        v = check_decode_metadata(layout, spec(topk=2), [s[:dp] for s in sched])
        assert v, v.report()


def test_capture_counting_requests_is_caught():
    with mutants.get("decode-capture-counts-requests").planted():
        v = check_decode_metadata(PL(4, 2, True), spec(topk=2), [(3, 1)])
    assert not v and v.failures[0].check == "I1"


# ---- eager vs graph, padded lanes ----
def _workers(comm, topk):
    ctx = RankContext(PL(), 0, comm)
    ws = [DraftWorker(ctx, MODEL, spec(topk), num_layers=1, max_reqs=8, num_slots=512) for _ in range(2)]
    kv = torch.randn(ws[0].kv_pool.k[0].shape, generator=torch.Generator().manual_seed(1))
    for w in ws:
        for r in range(1, 8):  # request r owns slots 64r .. 64r + 63 (row 0 stays the padding row)
            w.req_pool.req_to_token[r] = torch.arange(r * 64, r * 64 + 64)
        w.kv_pool.k[0].copy_(kv)
        w.kv_pool.v[0].copy_(kv * 0.5)
    return ws


def _inputs(bs, topk, seed, rows=None):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(5, 30, (bs,), generator=g)
    p = torch.rand(bs, topk, generator=g).sort(dim=1, descending=True).values
    rows = torch.arange(1, bs + 1) if rows is None else torch.tensor(rows)
    return DraftDecodeInputs(p, torch.randint(0, MODEL.vocab_size, (bs, topk), generator=g), torch.randn(bs, MODEL.hidden_size, generator=g),
                             seq, rows, seq.repeat_interleave(topk), [bs])


@pytest.mark.parametrize("topk", [1, 2])
def test_eager_vs_graph_bitwise_at_a_full_bucket(topk):
    def fn(comm):
        eager, graph = _workers(comm, topk)
        runner = EAGLEDraftCudaGraphRunner(graph, GraphBackend("sim"))
        observer = RunnerObserver(runner).attach()
        runner.capture()
        inp = _inputs(4, topk, seed=3)  # bucket 4 = raw bs: the same ops on the same shapes
        e = run_eager_decode(eager, inp)
        g = runner.replay(inp)
        assert runner.backend.stats.replays == 1 and [r.bs for r in observer.replays] == [4]
        for name, t in e.tensors().items():
            assert torch.equal(t, g.tensors()[name]), name
        # the same slots written with the same values; slot 0 (padding) took the capture's writes
        assert torch.equal(eager.kv_pool.k[0][1:], graph.kv_pool.k[0][1:])
        return True

    assert SimulatedWorld(PL()).run(fn) == [True]


def _stale_row_run(comm, topk):
    """A batch of 4 requests, then requests 1-3 in bucket 4: lane 3 is padded, and before the fill it held request 4."""
    eager, graph = _workers(comm, topk)
    runner = EAGLEDraftCudaGraphRunner(graph, GraphBackend("sim"))
    observer = RunnerObserver(runner).attach()
    runner.capture()
    big = _inputs(4, topk, seed=5)
    run_eager_decode(eager, big)
    runner.replay(big)
    before = graph.kv_pool.k[0].clone()
    small = _inputs(3, topk, seed=6, rows=[1, 2, 3])
    e = run_eager_decode(eager, small)
    g = runner.replay(small)
    rec = observer.replays[-1]
    assert (rec.raw_bs, rec.bs) == (3, 4)
    written = {0}  # the padding slot, and each request's draft slots: topk * (num_steps - 1) from its seq_len on
    for r, seq in zip((1, 2, 3), small.seq_lens.tolist(), strict=True):
        written |= set(range(64 * r + seq, 64 * r + seq + topk * 2))
    others = torch.ones(before.shape[0], dtype=torch.bool)
    others[sorted(written)] = False
    return torch.equal(before[others], graph.kv_pool.k[0][others]), e, g


@pytest.mark.parametrize("topk", [1, 2])
def test_padded_lane_writes_only_the_padding_slot(topk):
    def fn(comm):
        untouched, e, g = _stale_row_run(comm, topk)
        assert untouched  # no live request's KV moved
        for name in ("tokens", "parents", "child_index"):
            assert torch.equal(e.tensors()[name], g.tensors()[name]), name
        assert torch.allclose(e.scores, g.scores, rtol=1e-5, atol=1e-5)  # another GEMM M than eager (harness.props.tolerances)
        return True

    assert SimulatedWorld(PL()).run(fn) == [True]


def test_stale_request_row_corrupts_live_kv():
    """The test above can fail: without the req_pool_indices fill the padded lane writes into request 2's prefix."""
    with mutants.get("decode-fill-req-pool-indices").planted():
        assert SimulatedWorld(PL()).run(lambda comm: _stale_row_run(comm, 1)[0]) == [False]


def test_every_bucket_captures_after_two_warm_ups_each_followed_by_a_world_barrier():
    """The capture loop's collectives are the engine's on every graph backend: per bucket, two warm-up passes, each
    followed by a world barrier (a recorded CPU graph needs no second pass for its own sake, but real NCCL ranks' CUDA
    graphs run it, and sim-vs-real compares the simulated ranks' trace with theirs call by call)."""
    world = SimulatedWorld(PL())

    def fn(comm):
        _, worker = _workers(comm, 2)
        runner = EAGLEDraftCudaGraphRunner(worker, GraphBackend("sim"))
        runner.capture()
        return len(runner.capture_bs)

    [buckets] = world.run(fn)
    [trace] = world.traces
    assert buckets > 1
    assert [(c.op, c.group) for c in trace] == [("barrier", "world")] * (2 * buckets)


# ---- through the loop ----
def test_single_layer_case_through_the_loop():
    out = check_decode_case(load_case("tp2_single_layer_shrink"))
    assert all(v.ok for v in out.values()), {k: v.report(2) for k, v in out.items()}
    assert out["P3"].checked > 0 and out["P1"].checked > 0


def test_poisoned_padded_lanes_are_harmless_and_the_position_fill_matters():
    v = check_decode_padded_lanes(2)
    assert v and v.checked > 0, v.report()
    with mutants.get("decode-fill-positions").planted():
        bad = check_decode_padded_lanes(2)
    assert not bad and "IndexError" in bad.failures[0].got
