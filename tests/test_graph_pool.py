"""The CPU graphs of one GraphBackend share a pool as CUDA graphs of one graph pool do (runners/graph/pool.py):
what a capture made, its outputs aside, is free for the next capture, so replaying an earlier-captured graph
overwrites a later graph's output placed there. Values below are worked out by hand."""
import torch

from runners.draft_extend import StepOutputs
from runners.graph.backend import GraphBackend
from runners.graph.pool import RecordedPool, tensors_in
from runners.graph.record import RecordedGraph


def _two_graphs(pool_a: RecordedPool, pool_b: RecordedPool):
    x = torch.zeros(4)
    y = torch.zeros(4)

    def body_a():
        t = x + 1  # an intermediate: freed when A's capture ends
        return t * 2  # A's output: kept

    def body_b():
        return y * 3  # B's output: placed in A's freed intermediate when the pool is shared

    a, b = RecordedGraph(body_a, pool_a), RecordedGraph(body_b, pool_b)
    a.capture()
    b.capture()
    return x, y, a, b


def test_an_earlier_graphs_replay_overwrites_a_later_graphs_output_in_its_freed_memory():
    pool = RecordedPool()
    x, y, a, b = _two_graphs(pool, pool)
    assert pool.placed == 1
    y.fill_(5)
    b.replay()
    assert b.output.tolist() == [15.0] * 4
    x.fill_(10)
    a.replay()  # writes its intermediate x + 1 = 11 where B's output sits
    assert a.output.tolist() == [22.0] * 4
    assert b.output.tolist() == [11.0] * 4
    b.replay()
    kept = b.output.clone()  # what a consumer must do before another graph of the pool replays
    a.replay()
    assert kept.tolist() == [15.0] * 4 and b.output.tolist() == [11.0] * 4


def test_outputs_are_never_freed_and_separate_pools_never_share():
    x, y, a, b = _two_graphs(RecordedPool(), RecordedPool())
    y.fill_(5)
    b.replay()
    x.fill_(10)
    a.replay()
    assert b.output.tolist() == [15.0] * 4 and a.output.tolist() == [22.0] * 4
    pool = RecordedPool()
    x, y, a, b = _two_graphs(pool, pool)
    assert pool.free == []  # A's one freed block holds B's output
    c = RecordedGraph(lambda: (y + 1) * 2, pool)  # its intermediate y + 1 is freed when its capture ends
    c.capture()
    outputs = {t.untyped_storage().data_ptr() for g in (a, b, c) for t in tensors_in(g.output)}
    free = [block.data_ptr() for _, _, block in pool.free]
    assert len(free) == 1 and not outputs & set(free)  # the block free after the captures is no output's


def test_a_backends_cpu_graphs_share_one_pool():
    gb = GraphBackend("sim")
    g1, g2 = gb.capture(lambda: torch.ones(3) + 1), gb.capture(lambda: torch.ones(3) * 2)
    assert g1.pool is g2.pool is gb.pool and isinstance(gb.pool, RecordedPool)


def test_tensors_in_finds_every_tensor_of_a_runners_outputs():
    ts = [torch.full((1,), float(i)) for i in range(7)]
    found = list(tensors_in(([StepOutputs(*ts)], {"k": ts[0]})))
    assert [float(t) for t in found] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0]
