"""The simulated-ranks communicator: results, determinism and traces (failure reports and no leaks:
tests/test_simulated_rank_failures.py).

Expectations are written out by hand (small integer tensors) or as closed forms of the
per-rank inputs, never by calling the communicator under test a second time.
"""
from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.ranks import run
from harness.ranks.simulated import RankFailure, SimComm, SimulatedWorld, compare_traces
from harness.ranks.trace import CollectiveCall
from runners.parallel.comm import Communicator, Group, group_rank
from runners.parallel.layout import ParallelLayout
from tests.helpers.simulated_world_helpers import (  # noqa: F401
    DP,
    L1,
    L2,
    L4,
    L4DP2,
    L8,
    L8DP2,
    L8DP4,
    LAYOUT_IDS,
    LAYOUTS,
    TP,
    W,
    no_thread_leak,
)


def _fail(layout: ParallelLayout, fn, timeout_s: float = 30.0) -> tuple[RankFailure, float]:
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        SimulatedWorld(layout, timeout_s=timeout_s).run(fn)
    return info.value, time.monotonic() - t0


# ---------------------------------------------------------------- groups


def test_group_ranks_of_dp_attention_layout():
    def fn(c: SimComm):
        return c.group_ranks(W), c.group_ranks(TP), c.group_ranks(DP)

    res = SimulatedWorld(L4DP2).run(fn)
    assert res == [
        ([0, 1, 2, 3], [0, 1], [0, 2]),
        ([0, 1, 2, 3], [0, 1], [1, 3]),
        ([0, 1, 2, 3], [2, 3], [0, 2]),
        ([0, 1, 2, 3], [2, 3], [1, 3]),
    ]


def test_simcomm_is_a_communicator():
    res = SimulatedWorld(L2).run(lambda c: (isinstance(c, Communicator), c.rank, c.world_size))
    assert res == [(True, 0, 2), (True, 1, 2)]


# ---------------------------------------------------------------- hand-computed results, dp-attention layout


def test_all_reduce_literal_l4dp2():
    res = SimulatedWorld(L4DP2).run(
        lambda c: [c.all_reduce(torch.tensor([c.rank]), g).item() for g in (W, TP, DP)]
    )
    # WORLD: 0+1+2+3; ATTN_TP: {0,1}->1, {2,3}->5; ATTN_DP: {0,2}->2, {1,3}->4
    assert res == [[6, 1, 2], [6, 1, 4], [6, 5, 2], [6, 5, 4]]


def test_all_gather_literal_l4dp2():
    res = SimulatedWorld(L4DP2).run(
        lambda c: [c.all_gather(torch.tensor([[c.rank, 10 * c.rank]]), g).tolist() for g in (TP, DP)]
    )
    assert res == [
        [[[0, 0], [1, 10]], [[0, 0], [2, 20]]],
        [[[0, 0], [1, 10]], [[1, 10], [3, 30]]],
        [[[2, 20], [3, 30]], [[0, 0], [2, 20]]],
        [[[2, 20], [3, 30]], [[1, 10], [3, 30]]],
    ]


def test_reduce_scatter_literal_l4dp2():
    # rank r contributes arange(4) * (r + 1); group {0,1} sums to [0,3,6,9], group {2,3} to [0,7,14,21]
    res = SimulatedWorld(L4DP2).run(lambda c: c.reduce_scatter(torch.arange(4) * (c.rank + 1), TP).tolist())
    assert res == [[0, 3], [6, 9], [0, 7], [14, 21]]


def test_all_gather_v_literal_l4dp2():
    # member i contributes t[:lengths[i]]; every rank's t has 3 rows filled with its rank
    res = SimulatedWorld(L4DP2).run(
        lambda c: c.all_gather_v(torch.full((3, 2), c.rank), [1, 3], TP).tolist()
    )
    assert res[0] == res[1] == [[0, 0], [1, 1], [1, 1], [1, 1]]
    assert res[2] == res[3] == [[2, 2], [3, 3], [3, 3], [3, 3]]


def test_broadcast_src_is_a_group_rank_l4dp2():
    res = SimulatedWorld(L4DP2).run(
        lambda c: [c.broadcast(torch.tensor([c.rank]), 1, g).item() for g in (W, TP, DP)]
    )
    # src group rank 1: WORLD -> global 1; ATTN_TP {0,1} -> 1, {2,3} -> 3; ATTN_DP {0,2} -> 2, {1,3} -> 3
    assert res == [[1, 1, 2], [1, 1, 3], [1, 3, 2], [1, 3, 3]]


def test_world_size_1_is_identity():
    x = torch.arange(6.0).reshape(3, 2)

    def fn(c: SimComm):
        outs = [
            c.all_reduce(x, W),
            c.all_gather(x, TP),
            c.reduce_scatter(x, DP),
            c.all_gather_v(x, [2], W),
            c.broadcast(x, 0, W),
        ]
        c.barrier(W)
        return outs

    (outs,) = SimulatedWorld(L1).run(fn)
    for out in outs[:3] + outs[4:]:
        assert torch.equal(out, x) and out is not x and out.data_ptr() != x.data_ptr()
    assert torch.equal(outs[3], x[:2])


# ---------------------------------------------------------------- closed forms, every layout


def _x(rank: int) -> torch.Tensor:
    """Rank r's input: arange(8 * 3) + 100 r, shaped (8, 3) (8 rows: divisible by every group size)."""
    return (torch.arange(24) + 100 * rank).reshape(8, 3)


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("group", [W, TP, DP], ids=lambda g: g.value)
def test_every_collective_closed_form(layout: ParallelLayout, group: Group):
    def fn(c: SimComm):
        x = _x(c.rank)
        lengths = [i % 3 for i in range(len(c.group_ranks(group)))]  # 0, 1, 2, 0, ...
        c.barrier(group)
        return (
            c.all_reduce(x, group),
            c.all_gather(x, group),
            c.reduce_scatter(x, group),
            c.all_gather_v(x, lengths, group),
            c.broadcast(x, len(c.group_ranks(group)) - 1, group),
        )

    res = SimulatedWorld(layout).run(fn)
    for rank, (ar, ag, rs, agv, bc) in enumerate(res):
        ranks = layout.group_ranks(group, rank)
        g = len(ranks)
        base = torch.arange(24).reshape(8, 3)
        total = base * g + 100 * sum(ranks)
        assert torch.equal(ar, total)
        assert torch.equal(ag, torch.cat([base + 100 * r for r in ranks]))
        me = ranks.index(rank)
        rows = 8 // g
        assert torch.equal(rs, total[me * rows : (me + 1) * rows])
        assert torch.equal(agv, torch.cat([(base + 100 * r)[: i % 3] for i, r in enumerate(ranks)]))
        assert torch.equal(bc, base + 100 * ranks[-1])


@pytest.mark.parametrize("layout", [L1, L2, L4DP2, L8DP4], ids=lambda lay: lay.describe())
def test_empty_tensors(layout: ParallelLayout):
    def fn(c: SimComm):
        e = torch.empty(0, 4)
        g = len(c.group_ranks(TP))
        return (
            c.all_reduce(e, TP).shape,
            c.all_gather(e, TP).shape,
            c.reduce_scatter(e, TP).shape,
            c.all_gather_v(torch.empty(0, 4), [0] * g, TP).shape,
            c.broadcast(e, 0, TP).shape,
        )

    for shapes in SimulatedWorld(layout).run(fn):
        assert shapes == (torch.Size([0, 4]),) * 5


def test_outputs_are_fresh_and_private():
    """No rank gets its own input or a peer's tensor back, and no two members share storage."""
    inputs: dict[int, torch.Tensor] = {}

    def fn(c: SimComm):
        x = torch.full((4,), float(c.rank))
        inputs[c.rank] = x
        outs = [c.all_reduce(x, W), c.all_gather(x, W), c.reduce_scatter(x, W), c.broadcast(x, 0, W)]
        outs.append(c.all_gather_v(x, [1, 1, 1, 1], W))
        return outs

    res = SimulatedWorld(L4).run(fn)
    ptrs = [o.data_ptr() for outs in res for o in outs] + [x.data_ptr() for x in inputs.values()]
    assert len(set(ptrs)) == len(ptrs)
    res[0][3].fill_(-1.0)  # scribbling on rank 0's broadcast result touches nobody else
    assert res[1][3].tolist() == [0.0] * 4 and inputs[0].tolist() == [0.0] * 4


# ---------------------------------------------------------------- determinism


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", [L4, L8, L8DP2], ids=lambda lay: lay.describe())
def test_all_reduce_bitwise_identical_in_group_rank_order(layout: ParallelLayout, dtype: torch.dtype):
    def x(rank: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1234 + rank)
        # mixed magnitudes so that a different summation order would round differently
        return (torch.randn(257, generator=gen) * 10.0 ** (rank % 4 - 2)).to(dtype)

    res = SimulatedWorld(layout).run(lambda c: (c.all_reduce(x(c.rank), W), c.all_reduce(x(c.rank), TP)))
    for which, group in ((0, W), (1, TP)):
        for rank in range(layout.world_size):
            ranks = layout.group_ranks(group, rank)
            expect = x(ranks[0]).clone()
            for r in ranks[1:]:
                expect += x(r)
            got = res[rank][which]
            assert got.dtype == dtype
            assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               expect.view(torch.int16 if dtype != torch.float32 else torch.int32))


@given(
    layout=st.sampled_from(LAYOUTS),
    group=st.sampled_from([W, TP, DP]),
    rows_per_member=st.integers(0, 3),
    cols=st.integers(1, 5),
)
def test_property_reduce_scatter_then_all_gather_is_all_reduce(layout, group, rows_per_member, cols):
    """all_gather(reduce_scatter(x)) == all_reduce(x), bitwise, on every member of every group."""

    def fn(c: SimComm):
        g = len(c.group_ranks(group))
        gen = torch.Generator().manual_seed(c.rank)
        x = torch.randn(g * rows_per_member, cols, generator=gen)
        return c.all_gather(c.reduce_scatter(x, group), group), c.all_reduce(x, group), group_rank(c, group)

    for gathered, reduced, _ in SimulatedWorld(layout).run(fn):
        assert torch.equal(gathered, reduced)


# ---------------------------------------------------------------- traces


def _traced_program(c: SimComm, dp_rows: int = 2):
    c.all_reduce(torch.zeros(2, 3), TP)
    c.all_gather(torch.zeros(dp_rows), DP)
    c.barrier(W)
    c.broadcast(torch.zeros(1, dtype=torch.int64), 0, TP)
    return c.rank


def test_traces_record_every_call_in_order():
    res, traces = run(L4DP2, _traced_program)
    assert res == [0, 1, 2, 3]
    assert traces[2] == [
        CollectiveCall(0, "all_reduce", "attn_tp", (2, 3), (2, 3), "torch.float32"),
        CollectiveCall(1, "all_gather", "attn_dp", (0, 2), (2,), "torch.float32"),
        CollectiveCall(2, "barrier", "world", (0, 1, 2, 3), (), ""),
        CollectiveCall(3, "broadcast", "attn_tp", (2, 3), (1,), "torch.int64"),
    ]
    assert [c.group_ranks for c in traces[1]] == [(0, 1), (1, 3), (0, 1, 2, 3), (0, 1)]


def test_traces_kept_after_a_failing_run_and_reset_per_run():
    world = SimulatedWorld(L2)
    world.run(_traced_program)
    assert len(world.traces[0]) == 4

    def fn(c: SimComm):
        c.barrier(W)
        if c.rank == 1:
            raise ValueError("x")
        c.all_reduce(torch.zeros(1), W)

    with pytest.raises(RankFailure):
        world.run(fn)
    assert [call.op for call in world.traces[0]] == ["barrier", "all_reduce"]
    assert [call.op for call in world.traces[1]] == ["barrier"]


def test_compare_traces_equal_and_planted_difference():
    _, a = run(L4DP2, _traced_program)
    _, b = run(L4DP2, _traced_program)
    assert compare_traces(a, b) is None
    # ATTN_DP group {1,3} gathers 3 rows in run c: consistent within the group, so the run succeeds
    _, c = run(L4DP2, lambda comm: _traced_program(comm, dp_rows=3 if comm.rank in (1, 3) else 2))
    assert compare_traces(a, c) == (
        "rank 1 call #1: a called all_gather(group=attn_dp, shape=(2,), dtype=float32) over ranks (1, 3), "
        "b called all_gather(group=attn_dp, shape=(3,), dtype=float32) over ranks (1, 3)"
    )


def test_compare_traces_lengths_and_world_sizes():
    _, a = run(L2, _traced_program)
    shorter = [a[0], a[1][:2]]
    assert compare_traces(a, shorter) == (
        "rank 1 call #2: a called barrier(group=world, shape=(), dtype=) over ranks (0, 1), "
        "b called nothing (its trace ends after 2 calls)"
    )
    assert compare_traces(a, a[:1]) == "world sizes differ: a has 2 ranks, b has 1"
