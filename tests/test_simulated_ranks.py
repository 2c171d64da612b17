"""The simulated-ranks communicator: results, determinism, failure reports, traces, no leaks.

Expectations are written out by hand (small integer tensors) or as closed forms of the
per-rank inputs, never by calling the communicator under test a second time.
"""
from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.ranks import RanksKind, run
from harness.ranks.simulated import (
    PeerFailed,
    RankFailure,
    SimComm,
    SimulatedWorld,
    compare_traces,
)
from harness.ranks.trace import CollectiveCall, CollectiveError, CollectiveMismatch, CollectiveTimeout
from runners.parallel.comm import Communicator, Group, group_rank
from runners.parallel.layout import ParallelLayout

W, TP, DP = Group.WORLD, Group.ATTN_TP, Group.ATTN_DP

L1 = ParallelLayout()
L2 = ParallelLayout(tp_size=2)
L4 = ParallelLayout(tp_size=4)
L4DP2 = ParallelLayout(tp_size=4, dp_size=2, enable_dp_attention=True)  # ATTN_TP {0,1},{2,3}; ATTN_DP {0,2},{1,3}
L8 = ParallelLayout(tp_size=8)
L8DP2 = ParallelLayout(tp_size=8, dp_size=2, enable_dp_attention=True)  # ATTN_TP {0..3},{4..7}; ATTN_DP {r, r+4}
L8DP4 = ParallelLayout(tp_size=8, dp_size=4, enable_dp_attention=True)  # ATTN_TP pairs; ATTN_DP {r, r+2, r+4, r+6}
LAYOUTS = [L1, L2, L4, L4DP2, L8, L8DP2, L8DP4]
LAYOUT_IDS = [lay.describe() for lay in LAYOUTS]

FAST_S = 2.0  # failures that need no deadline must be reported well within this


def _sim_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("simrank-")]


@pytest.fixture(autouse=True)
def no_thread_leak():
    # compare thread sets, not counts: pytest-timeout's timer thread may end between setup and teardown
    before = set(threading.enumerate())
    yield
    assert _sim_threads() == [], "simulated-rank threads still alive after the test"
    assert set(threading.enumerate()) - before == set()


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


# ---------------------------------------------------------------- mismatches


def _msg(exc: BaseException) -> str:
    return str(exc)


def assert_mismatch(msg: str, odd: int, odd_call: str, peers: list[int], peer_call: str, *labels: str) -> None:
    """The odd rank and both calls are named; either side may be the reference (whoever arrived first).

    The slot label takes its group name from the first arrival, so a test may allow several labels.
    """
    p = "[" + "".join(map(str, peers)) + "]"
    odd_first = f"rank {odd} called {re.escape(odd_call)} where rank {p} called {re.escape(peer_call)}"
    peer_first = f"rank {p} called {re.escape(peer_call)} where rank {odd} called {re.escape(odd_call)}"
    label = "|".join(re.escape(f"[{lab}]") for lab in labels)
    assert re.search(f"(?:{odd_first}|{peer_first}) (?:{label})", msg), msg


def test_mismatched_op_raises_on_all_members_fast():
    def fn(c: SimComm):
        x = torch.zeros(4)
        return c.all_gather(x, W) if c.rank == 2 else c.all_reduce(x, W)

    err, elapsed = _fail(L4, fn)
    assert elapsed < FAST_S
    assert sorted(err.failures) == [0, 1, 2, 3]
    assert all(isinstance(e, CollectiveMismatch) for e, _ in err.failures.values())
    assert_mismatch(
        _msg(err),
        2, "all_gather(group=world, shape=(4,), dtype=float32)",
        [0, 1, 3], "all_reduce(group=world, shape=(4,), dtype=float32)",
        "collective #0 of group world(ranks 0,1,2,3)",
    )


def test_mismatched_shape_only_fails_its_group_instance():
    """ATTN_TP of DP group 0 (ranks 0,1) and of DP group 1 (ranks 2,3) are independent."""

    def fn(c: SimComm):
        return c.all_gather(torch.zeros((3, 64) if c.rank == 1 else (12, 64)), TP).shape

    err, elapsed = _fail(L4DP2, fn)
    assert elapsed < FAST_S
    assert sorted(err.failures) == [0, 1]  # ranks 2, 3 gathered fine in their own ATTN_TP group
    for r in (0, 1):
        assert isinstance(err.failures[r][0], CollectiveMismatch)
        assert_mismatch(
            str(err.failures[r][0]),
            1, "all_gather(group=attn_tp, shape=(3, 64), dtype=float32)",
            [0], "all_gather(group=attn_tp, shape=(12, 64), dtype=float32)",
            "collective #0 of group attn_tp(ranks 0,1)",
        )


def test_mismatched_dtype():
    def fn(c: SimComm):
        c.all_reduce(torch.zeros(2), W)  # collective #0 agrees
        return c.all_reduce(torch.zeros(2, dtype=torch.float64 if c.rank == 3 else torch.float32), W)

    err, elapsed = _fail(L4, fn)
    assert elapsed < FAST_S
    assert_mismatch(
        _msg(err),
        3, "all_reduce(group=world, shape=(2,), dtype=float64)",
        [0, 1, 2], "all_reduce(group=world, shape=(2,), dtype=float32)",
        "collective #1 of group world(ranks 0,1,2,3)",
    )


def test_mismatched_group_name_over_the_same_ranks():
    """Without DP attention ATTN_TP and WORLD are the same ranks, but they are different groups."""
    err, elapsed = _fail(L2, lambda c: c.all_reduce(torch.zeros(2), TP if c.rank == 1 else W))
    assert elapsed < FAST_S
    assert_mismatch(
        _msg(err),
        1, "all_reduce(group=attn_tp, shape=(2,), dtype=float32)",
        [0], "all_reduce(group=world, shape=(2,), dtype=float32)",
        "collective #0 of group attn_tp(ranks 0,1)",
        "collective #0 of group world(ranks 0,1)",
    )


def test_mismatched_all_gather_v_lengths_and_trailing_dims():
    err, _ = _fail(L2, lambda c: c.all_gather_v(torch.zeros(3, 2), [1, 2] if c.rank == 1 else [1, 1], W))
    assert_mismatch(
        _msg(err),
        1, "all_gather_v(group=world, shape=(3, 2), dtype=float32) with lengths=[1, 2]",
        [0], "all_gather_v(group=world, shape=(3, 2), dtype=float32) with lengths=[1, 1]",
        "collective #0 of group world(ranks 0,1)",
    )

    err, _ = _fail(L2, lambda c: c.all_gather_v(torch.zeros(3, 2 + c.rank), [1, 1], W))
    assert_mismatch(
        _msg(err),
        1, "all_gather_v(group=world, shape=(3, 3), dtype=float32) with lengths=[1, 1]",
        [0], "all_gather_v(group=world, shape=(3, 2), dtype=float32) with lengths=[1, 1]",
        "collective #0 of group world(ranks 0,1)",
    )

    # a different dim 0 is fine for all_gather_v: only trailing dims and lengths must agree
    res = SimulatedWorld(L2).run(lambda c: c.all_gather_v(torch.full((1 + 2 * c.rank, 2), c.rank), [1, 3], W))
    assert res[0].tolist() == res[1].tolist() == [[0, 0], [1, 1], [1, 1], [1, 1]]


def test_mismatched_broadcast_src():
    err, _ = _fail(L2, lambda c: c.broadcast(torch.zeros(2), c.rank, W))
    assert_mismatch(
        _msg(err),
        1, "broadcast(group=world, shape=(2,), dtype=float32) with src=1",
        [0], "broadcast(group=world, shape=(2,), dtype=float32) with src=0",
        "collective #0 of group world(ranks 0,1)",
    )


def test_cross_group_order_deadlock_is_reported_not_waited_out():
    """Rank 1 orders its ATTN_TP and WORLD collectives differently: NCCL would hang forever."""

    def fn(c: SimComm):
        x = torch.zeros(2)
        order = (TP, W) if c.rank == 1 else (W, TP)
        return [c.all_reduce(x, g) for g in order]

    err, elapsed = _fail(L4DP2, fn, timeout_s=30.0)
    assert elapsed < FAST_S
    assert all(isinstance(e, CollectiveMismatch) for e, _ in err.failures.values())
    msg = _msg(err)
    assert "deadlock" in msg
    assert "rank 1 waiting in all_reduce(group=attn_tp, shape=(2,), dtype=float32) " \
           "[collective #0 of group attn_tp(ranks 0,1)], missing ranks [0]" in msg
    assert "rank 0 waiting in all_reduce(group=world, shape=(2,), dtype=float32) " \
           "[collective #0 of group world(ranks 0,1,2,3)], missing ranks [1]" in msg


# ---------------------------------------------------------------- skipped collectives, raising ranks


def test_rank_that_returns_early_is_named_with_the_collective():
    def fn(c: SimComm):
        c.all_reduce(torch.zeros(2), W)
        if c.rank == 3:
            return "skipped"
        return c.all_gather(torch.zeros(5, 7), W)

    err, elapsed = _fail(L4, fn, timeout_s=30.0)
    assert elapsed < FAST_S
    assert sorted(err.failures) == [0, 1, 2]  # rank 3 itself returned fine
    assert all(isinstance(e, CollectiveMismatch) for e, _ in err.failures.values())
    assert "rank 3 returned from fn without calling all_gather(group=world, shape=(5, 7), dtype=float32) " \
           "[collective #1 of group world(ranks 0,1,2,3)]" in _msg(err)


def test_rank_that_raises_wakes_peers_and_is_the_root_cause():
    def fn(c: SimComm):
        if c.rank == 1:
            time.sleep(0.2)  # peers are blocked in the all_reduce by now
            raise ValueError("boom on rank 1")
        return c.all_reduce(torch.zeros(2), W)

    err, elapsed = _fail(L4, fn, timeout_s=30.0)
    assert elapsed < FAST_S
    assert err.root_rank == 1
    assert isinstance(err.root_exception, ValueError)
    assert sorted(err.failures) == [0, 1, 2, 3]
    for r in (0, 2, 3):
        exc = err.failures[r][0]
        assert isinstance(exc, PeerFailed) and isinstance(exc, CollectiveError)
        assert str(exc) == "peer rank 1 failed: ValueError: boom on rank 1"
    msg = _msg(err)
    assert msg.startswith("rank 1 failed: ValueError: boom on rank 1\n")
    assert "traceback of rank 1:" in msg and "raise ValueError" in msg


def test_failure_cascades_across_groups_to_the_root_cause():
    """Rank 5 raises; its ATTN_TP peers fail; ranks 0..3 then fail in WORLD because of those."""

    def fn(c: SimComm):
        if c.rank == 5:
            raise KeyError("rank 5 lost its kv cache")
        c.all_reduce(torch.zeros(2), TP)
        return c.all_reduce(torch.zeros(2), W)

    err, elapsed = _fail(L8DP2, fn, timeout_s=30.0)
    assert elapsed < FAST_S
    assert sorted(err.failures) == list(range(8))
    assert err.root_rank == 5
    assert _msg(err).startswith("rank 5 failed: KeyError")
    assert all(isinstance(err.failures[r][0], PeerFailed) for r in range(8) if r != 5)


def test_rank_that_raised_before_peers_arrive():
    """Peers that reach the collective after the failure fail at once too."""

    def fn(c: SimComm):
        if c.rank == 0:
            raise RuntimeError("early")
        time.sleep(0.1)
        return c.barrier(W)

    err, elapsed = _fail(L2, fn, timeout_s=30.0)
    assert elapsed < FAST_S and err.root_rank == 0
    assert str(err.failures[1][0]) == "peer rank 0 failed: RuntimeError: early"


# ---------------------------------------------------------------- deadlines


def test_sleeping_rank_hits_the_deadline_and_is_named():
    def fn(c: SimComm):
        c.all_gather(torch.zeros(2), TP)
        if c.rank == 3:
            time.sleep(1.0)
        return c.all_reduce(torch.zeros(2), W)

    err, elapsed = _fail(L4DP2, fn, timeout_s=0.5)
    assert 0.5 <= elapsed < FAST_S
    root = err.root_exception
    assert isinstance(root, CollectiveTimeout)
    assert err.root_rank in (0, 1, 2)
    assert str(root) == (
        f"rank {err.root_rank} waited more than 0.5s in all_reduce(group=world, shape=(2,), dtype=float32) "
        "[collective #0 of group world(ranks 0,1,2,3)]: arrived: ranks [0, 1, 2]; never arrived: rank 3 "
        "(running; last collective call #0: all_gather(group=attn_tp, shape=(2,), dtype=float32))"
    )
    # the other waiters and the late rank fail as consequences of the timeout
    for r in set(range(4)) - {err.root_rank}:
        assert isinstance(err.failures[r][0], PeerFailed), err.failures[r][0]


def test_deadline_reports_a_rank_that_never_called_a_collective():
    def fn(c: SimComm):
        if c.rank == 1:
            time.sleep(0.8)
            return None
        return c.all_reduce(torch.zeros(1), W)

    err, _ = _fail(L2, fn, timeout_s=0.3)
    assert err.root_rank == 0
    assert "never arrived: rank 1 (running; no collective called yet)" in _msg(err)


# ---------------------------------------------------------------- argument errors


def test_reduce_scatter_not_divisible_is_a_clear_error():
    err, elapsed = _fail(L4, lambda c: c.reduce_scatter(torch.zeros(6, 2), W))
    assert elapsed < FAST_S
    assert isinstance(err.root_exception, ValueError)
    assert "reduce_scatter over world needs dim 0 (6) divisible by the group size (4)" in _msg(err)


def test_all_gather_v_argument_errors():
    err, _ = _fail(L2, lambda c: c.all_gather_v(torch.zeros(2, 1), [1], W))
    assert "needs one length per member (2), got [1]" in _msg(err)
    err, _ = _fail(L2, lambda c: c.all_gather_v(torch.zeros(2, 1), [1, 3], W))
    assert "rank 1: all_gather_v contributes t[:3] but t has only 2 rows" in _msg(err)


def test_run_is_not_reentrant():
    world = SimulatedWorld(L1)
    with pytest.raises(RankFailure, match="already running"):
        world.run(lambda c: world.run(lambda c2: None))


def test_comm_used_after_run_is_an_error():
    world = SimulatedWorld(L1)
    (comm,) = world.run(lambda c: c)
    with pytest.raises(RuntimeError, match="outside SimulatedWorld.run"):
        comm.barrier(W)


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


# ---------------------------------------------------------------- isolation


def test_concurrent_worlds_are_independent():
    def job(layout: ParallelLayout):
        return run(layout, lambda c: c.all_reduce(torch.tensor([float(c.rank)]), W).item())[0]

    layouts = [L2, L4, L8, L4DP2, L8DP4, L8DP2]
    with ThreadPoolExecutor(max_workers=len(layouts)) as pool:
        results = list(pool.map(job, layouts))
    for layout, res in zip(layouts, results, strict=True):
        n = layout.world_size
        assert res == [n * (n - 1) / 2] * n


def test_no_thread_leak_after_failures():
    baseline = threading.active_count()
    SimulatedWorld(L8).run(lambda c: c.barrier(W))
    _fail(L8, lambda c: c.all_reduce(torch.zeros(1 + (c.rank == 7)), W))
    _fail(L4, lambda c: (_ for _ in ()).throw(ValueError("x")) if c.rank == 0 else c.barrier(W))
    _fail(L2, lambda c: c.barrier(W) if c.rank == 0 else time.sleep(0.3), timeout_s=0.1)
    assert threading.active_count() == baseline
    assert _sim_threads() == []


def test_ranks_run_names_the_allowed_kinds_on_a_typo():
    with pytest.raises(ValueError, match=r"ranks: expected one of sim, gloo, nccl, got 'simm'"):
        run(L2, lambda c: c.rank, ranks="simm")


def test_ranks_run_takes_the_kind_as_enum_or_string_and_refuses_launch_options_for_threads():
    assert run(L2, lambda c: c.rank, ranks=RanksKind.SIM)[0] == run(L2, lambda c: c.rank, ranks="sim")[0] == [0, 1]
    with pytest.raises(TypeError, match="check_signatures"):
        run(L2, lambda c: c.rank, ranks="sim", check_signatures=True)
