"""The simulated-ranks communicator's failure reports (mismatches, ranks that return early or raise,
deadlines, argument errors), its traces, and isolation between worlds: every report names the rank and
the collective, and arrives fast where no deadline is needed.
"""
from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from harness.ranks import RanksKind, run
from harness.ranks.simulated import (
    PeerFailed,
    RankFailure,
    SimComm,
    SimulatedWorld,
)
from harness.ranks.trace import CollectiveError, CollectiveMismatch, CollectiveTimeout
from runners.parallel.layout import ParallelLayout
from tests.helpers.simulated_world_helpers import (  # noqa: F401
    DP,
    FAST_S,
    L1,
    L2,
    L4,
    L4DP2,
    L8,
    L8DP2,
    L8DP4,
    LAYOUTS,
    TP,
    W,
    no_thread_leak,
    sim_threads,
)


def _fail(layout: ParallelLayout, fn, timeout_s: float = 30.0) -> tuple[RankFailure, float]:
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        SimulatedWorld(layout, timeout_s=timeout_s).run(fn)
    return info.value, time.monotonic() - t0


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


def test_several_ranks_raising_name_the_lowest_whichever_raised_first():
    """The report is the same on every run: rank 2 raises first, rank 1 later, and rank 1 is named."""

    def fn(c: SimComm):
        if c.rank == 1:
            time.sleep(0.2)
        if c.rank in (1, 2):
            raise ValueError(f"boom on rank {c.rank}")
        return None

    err, _ = _fail(L4, fn, timeout_s=30.0)
    assert sorted(err.failures) == [1, 2]
    assert err.root_rank == 1
    assert _msg(err).startswith("rank 1 failed: ValueError: boom on rank 1\n")


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
    """Rank 3 stays away until a waiter has left the all_reduce, so only the deadline can end the wait: a world
    without one leaves rank 3 waiting out its own 60 s and the test fails on its assertion instead of a clock."""
    waiter_left = threading.Event()

    def fn(c: SimComm):
        c.all_gather(torch.zeros(2), TP)
        if c.rank == 3:
            assert waiter_left.wait(60), "no waiter left the all_reduce: the 0.5 s deadline never fired"
        try:
            return c.all_reduce(torch.zeros(2), W)
        finally:
            waiter_left.set()

    err, elapsed = _fail(L4DP2, fn, timeout_s=0.5)
    assert elapsed >= 0.5  # a lower bound only: load can lengthen the run, never shorten the deadline
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
    waiter_left = threading.Event()  # rank 1 is still running when the deadline fires, however loaded the machine

    def fn(c: SimComm):
        if c.rank == 1:
            assert waiter_left.wait(60), "rank 0 never left the all_reduce: the 0.3 s deadline never fired"
            return None
        try:
            return c.all_reduce(torch.zeros(1), W)
        finally:
            waiter_left.set()

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
    assert sim_threads() == []


def test_ranks_run_names_the_allowed_kinds_on_a_typo():
    with pytest.raises(ValueError, match=r"ranks: expected one of sim, gloo, nccl, got 'simm'"):
        run(L2, lambda c: c.rank, ranks="simm")


def test_ranks_run_takes_the_kind_as_enum_or_string_and_refuses_launch_options_for_threads():
    assert run(L2, lambda c: c.rank, ranks=RanksKind.SIM)[0] == run(L2, lambda c: c.rank, ranks="sim")[0] == [0, 1]
    with pytest.raises(TypeError, match="check_signatures"):
        run(L2, lambda c: c.rank, ranks="sim", check_signatures=True)
