"""Real ranks (torch.distributed, gloo on CPU): collectives, traces, hangs, mismatches,
failures, skips, orphan-freedom (signatures and the xdist GPU/port slicing: tests/test_rank_slicing.py).

Process spawns dominate the cost (torch import, ~2-3 s a rank), so each launched function
checks many things at once. Rank functions are module-level: they are pickled by name.
"""
from __future__ import annotations

import math
import multiprocessing
import os
import time

import pytest
import torch

from harness.ranks import launcher, supervisor
from harness.ranks.gpu_slice import (
    worker_gpus,
)
from harness.ranks.launcher import (
    SKIP_EXIT_CODE,
    DistributedDeadlock,
    DistributedMismatch,
    DistributedRankFailure,
    DistributedTimeout,
    LaunchSkipped,
    RankSkip,
    launch,
)
from harness.ranks.trace import CollectiveCall, CollectiveMismatch, CollectiveTimeout
from runners.parallel.comm import Group
from runners.parallel.layout import ParallelLayout
from tests.helpers.process_tree import live_children

pytestmark = pytest.mark.distributed

TP2 = ParallelLayout(tp_size=2)
TP4_DP2 = ParallelLayout(tp_size=4, dp_size=2, enable_dp_attention=True)  # attn_tp {0,1},{2,3}; attn_dp {0,2},{1,3}
GROUPS = (Group.WORLD, Group.ATTN_TP, Group.ATTN_DP)


# ---------------------------------------------------------------------------------------
# no process may outlive a test
# ---------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_leftover_processes():
    before = {pid for pid, _, _ in live_children()}
    yield
    assert multiprocessing.active_children() == []
    leftovers = [c for c in live_children() if c[0] not in before]
    assert leftovers == [], f"processes left behind: {leftovers}"


# ---------------------------------------------------------------------------------------
# every collective, every group, against computed and hand-written expectations
# ---------------------------------------------------------------------------------------


def _val(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(math.prod(shape), dtype=torch.float64) + 100 * rank).reshape(shape).to(dtype)


def _randn(rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1234 + rank))


def _program(comm) -> dict:
    """Every collective on every group; returns name -> result (plus input-integrity flags)."""
    r = comm.rank
    res: dict = {}
    for g in GROUPS:
        n = len(comm.group_ranks(g))
        x = _val(r, (4, 3))
        x0 = x.clone()
        k = g.value
        res[f"{k}/all_reduce"] = y = comm.all_reduce(x, g)
        res[f"{k}/fresh"] = y.data_ptr() != x.data_ptr()
        res[f"{k}/all_gather"] = comm.all_gather(x, g)
        res[f"{k}/reduce_scatter"] = comm.reduce_scatter(_val(r, (2 * n, 3)), g)
        res[f"{k}/all_gather_v"] = comm.all_gather_v(_val(r, (n + 1, 3)), [i + 1 for i in range(n)], g)
        res[f"{k}/all_gather_v_zeros"] = comm.all_gather_v(_val(r, (2, 3)), [0 if i % 2 else 2 for i in range(n)], g)
        res[f"{k}/broadcast"] = comm.broadcast(_val(r, (2,)), n - 1, g)
        res[f"{k}/int64"] = comm.all_reduce(torch.tensor([r, 10 * r]), g)
        res[f"{k}/bf16"] = comm.all_gather(_val(r, (2, 2), torch.bfloat16), g)
        res[f"{k}/bool"] = comm.all_gather(torch.tensor([r % 2 == 0]), g)
        res[f"{k}/empty_all_reduce"] = comm.all_reduce(torch.empty(0, 3), g)
        res[f"{k}/empty_all_gather"] = comm.all_gather(torch.empty(0, 3), g)
        res[f"{k}/empty_reduce_scatter"] = comm.reduce_scatter(torch.empty(2 * n, 0), g)
        res[f"{k}/empty_all_gather_v"] = comm.all_gather_v(torch.empty(0, 3), [0] * n, g)
        res[f"{k}/empty_broadcast"] = comm.broadcast(torch.empty(0), 0, g)
        res[f"{k}/literal"] = comm.all_reduce(torch.tensor([float(r)]), g)
        comm.barrier(g)
        res[f"{k}/input_intact"] = torch.equal(x, x0)
    # summation order: bitwise equal to the left fold in group-rank order
    res["fold/all_reduce"] = comm.all_reduce(_randn(r, 4096), Group.WORLD)
    res["fold/reduce_scatter"] = comm.reduce_scatter(_randn(r, 4096), Group.WORLD)
    return res


class _Recorder:
    """Records what _program calls (to build the expected trace); returns its input."""

    def __init__(self, layout: ParallelLayout, rank: int) -> None:
        self.layout, self.rank, self.world_size, self.calls = layout, rank, layout.world_size, []

    def group_ranks(self, g):
        return self.layout.group_ranks(g, self.rank)

    def _rec(self, op, g, t):
        shape, dtype = (tuple(t.shape), str(t.dtype)) if t is not None else ((), "")
        self.calls.append(CollectiveCall(len(self.calls), op, g.value, tuple(self.group_ranks(g)), shape, dtype))
        return t

    def all_reduce(self, t, g):
        return self._rec("all_reduce", g, t)

    def all_gather(self, t, g):
        return self._rec("all_gather", g, t)

    def reduce_scatter(self, t, g):
        return self._rec("reduce_scatter", g, t)

    def all_gather_v(self, t, lengths, g):
        return self._rec("all_gather_v", g, t)

    def broadcast(self, t, src, g):
        return self._rec("broadcast", g, t)

    def barrier(self, g):
        self._rec("barrier", g, None)


def _fold(parts):
    acc = parts[0].clone()
    for p in parts[1:]:
        acc = acc + p
    return acc


def _expected(layout: ParallelLayout, r: int) -> dict:
    ws = layout.world_size
    exp: dict = {}
    for g in GROUPS:
        G = layout.group_ranks(g, r)
        n, me, k = len(G), G.index(r), g.value
        exp[f"{k}/all_reduce"] = sum(_val(m, (4, 3), torch.float64) for m in G).float()
        exp[f"{k}/fresh"] = True
        exp[f"{k}/all_gather"] = torch.cat([_val(m, (4, 3)) for m in G])
        exp[f"{k}/reduce_scatter"] = sum(_val(m, (2 * n, 3), torch.float64) for m in G).float()[2 * me : 2 * me + 2]
        exp[f"{k}/all_gather_v"] = torch.cat([_val(m, (n + 1, 3))[: i + 1] for i, m in enumerate(G)])
        exp[f"{k}/all_gather_v_zeros"] = torch.cat([_val(m, (2, 3))[: 0 if i % 2 else 2] for i, m in enumerate(G)])
        exp[f"{k}/broadcast"] = _val(G[-1], (2,))
        exp[f"{k}/int64"] = torch.tensor([sum(G), 10 * sum(G)])
        exp[f"{k}/bf16"] = torch.cat([_val(m, (2, 2), torch.bfloat16) for m in G])
        exp[f"{k}/bool"] = torch.tensor([m % 2 == 0 for m in G])
        exp[f"{k}/empty_all_reduce"] = torch.empty(0, 3)
        exp[f"{k}/empty_all_gather"] = torch.empty(0, 3)
        exp[f"{k}/empty_reduce_scatter"] = torch.empty(2, 0)
        exp[f"{k}/empty_all_gather_v"] = torch.empty(0, 3)
        exp[f"{k}/empty_broadcast"] = torch.empty(0)
        exp[f"{k}/input_intact"] = True
    exp["fold/all_reduce"] = _fold([_randn(m, 4096) for m in range(ws)])
    exp["fold/reduce_scatter"] = _fold([_randn(m, 4096) for m in range(ws)]).chunk(ws)[r]
    return exp


# hand-written: all_reduce of [rank] over each rank's group instance
LITERAL = {
    TP2: {"world": [1.0, 1.0], "attn_tp": [1.0, 1.0], "attn_dp": [0.0, 1.0]},
    TP4_DP2: {"world": [6.0] * 4, "attn_tp": [1.0, 1.0, 5.0, 5.0], "attn_dp": [2.0, 4.0, 2.0, 4.0]},
}


def _check_collectives(layout: ParallelLayout, out, exact_fold: bool = True) -> None:
    ws = layout.world_size
    assert len(out.results) == len(out.traces) == ws
    for r in range(ws):
        got, exp = out.results[r], _expected(layout, r)
        for key, want in exp.items():
            have = got[key]
            if isinstance(want, bool):
                assert have is want, (r, key)
                continue
            assert have.dtype == want.dtype and have.shape == want.shape, (r, key, have, want)
            if key.startswith("fold/") and not exact_fold:
                torch.testing.assert_close(have, want)
            else:
                assert torch.equal(have, want), (r, key, have, want)
        for g, vals in LITERAL[layout].items():
            assert got[f"{g}/literal"].tolist() == [vals[r]], (r, g)
        rec = _Recorder(layout, r)
        _program(rec)
        assert out.traces[r] == rec.calls
    ops = [[(c.op, c.group, c.shape, c.dtype) for c in t] for t in out.traces]
    assert all(o == ops[0] for o in ops)  # SPMD: the same calls on every rank


@pytest.mark.parametrize("layout", [TP2, TP4_DP2], ids=["tp2", "tp4_dp2"])
def test_every_collective_on_gloo(layout):
    out = launch(layout, _program, backend="gloo", timeout_s=120)
    assert out.backend == "gloo"
    assert out.exit_codes == [0] * layout.world_size
    _check_collectives(layout, out)
    t = out.traces[layout.world_size - 1]
    assert t[0] == CollectiveCall(0, "all_reduce", "world", tuple(range(layout.world_size)), (4, 3), "torch.float32")


@pytest.mark.multigpu(2)
@pytest.mark.gpu
def test_every_collective_on_nccl():
    out = launch(TP2, _program, backend="nccl", timeout_s=120, check_signatures=True)
    assert out.backend == "nccl"
    _check_collectives(TP2, out, exact_fold=False)


# ---------------------------------------------------------------------------------------
# hangs, mismatches, failures, skips
# ---------------------------------------------------------------------------------------


def _rank1_skips_a_collective(comm):
    comm.all_reduce(torch.ones(4), Group.WORLD)
    if comm.rank == 1:
        return "left early"
    comm.all_reduce(torch.ones(4), Group.WORLD)  # rank 0 waits here for ever
    return "unreachable"


def test_planted_hang_is_reported_fast_naming_rank_and_collective():
    t0 = time.monotonic()
    with pytest.raises(DistributedDeadlock) as ei:
        launch(TP2, _rank1_skips_a_collective, backend="gloo", timeout_s=45)
    elapsed = time.monotonic() - t0
    msg = str(ei.value)
    assert isinstance(ei.value, DistributedTimeout) and isinstance(ei.value, CollectiveTimeout)
    assert "rank 0: stuck in all_reduce(group=world, shape=(4,), dtype=float32) [collective #1, entered]" in msg
    assert "rank 1: finished" in msg
    assert "rank 0 waits in a collective for rank 1" in msg
    assert ei.value.states == {0: "stuck in all_reduce(group=world, shape=(4,), dtype=float32) [collective #1, entered]", 1: "finished"}
    assert elapsed < 30, elapsed  # spawn + detection; far below the 45 s timeout


def _ranks_in_different_groups(comm):
    # Same ranks, different process groups: both block, nobody finishes -> only the timeout can tell.
    comm.all_reduce(torch.ones(4), Group.WORLD if comm.rank == 0 else Group.ATTN_TP)


def test_timeout_lists_every_rank_and_its_collective():
    t0 = time.monotonic()
    with pytest.raises(DistributedTimeout) as ei:
        launch(TP2, _ranks_in_different_groups, backend="gloo", timeout_s=2)
    assert not isinstance(ei.value, DistributedDeadlock)
    msg = str(ei.value)
    assert "timeout_s=2" in msg
    assert "rank 0: stuck in all_reduce(group=world, shape=(4,), dtype=float32) [collective #0, entered]" in msg
    assert "rank 1: stuck in all_reduce(group=attn_tp, shape=(4,), dtype=float32) [collective #0, entered]" in msg
    assert time.monotonic() - t0 < 40


def _mismatch_in_one_attn_tp_group(comm):
    x = torch.zeros(12, 64)
    if comm.rank == 2:
        comm.reduce_scatter(x, Group.ATTN_TP)
    else:
        comm.all_gather(x, Group.ATTN_TP)
    comm.all_reduce(torch.ones(3), Group.WORLD)  # ranks 0 and 1 wait here for 2 and 3


def test_planted_mismatch_names_both_collectives():
    with pytest.raises(DistributedMismatch) as ei:
        launch(TP4_DP2, _mismatch_in_one_attn_tp_group, backend="gloo", timeout_s=60, failure_grace_s=1.0)
    e = ei.value
    assert isinstance(e, CollectiveMismatch) and isinstance(e, DistributedRankFailure)
    msg = str(e)
    assert msg.startswith("collective mismatch in group attn_tp (ranks (2, 3))")
    assert (
        "rank 3 called all_gather(group=attn_tp, shape=(12, 64), dtype=float32) [its collective #0] "
        "where rank 2 called reduce_scatter(group=attn_tp, shape=(12, 64), dtype=float32)"
    ) in msg
    assert sorted(e.failures) == [2, 3]  # raised on every member of the group
    assert "CollectiveMismatch" in e.failures[2] and "_mismatch_in_one_attn_tp_group" in e.failures[3]
    for r in (0, 1):  # the innocent group: reported where it waited, then killed
        assert e.states[r] == "stuck in all_reduce(group=world, shape=(3,), dtype=float32) [collective #1, entered]"


def _rank1_raises(comm):
    if comm.rank == 1:
        raise ValueError("planted failure on rank 1")
    comm.all_reduce(torch.ones(2), Group.WORLD)


def test_rank_failure_carries_traceback_and_ends_promptly():
    t0 = time.monotonic()
    with pytest.raises(DistributedRankFailure) as ei:
        launch(TP2, _rank1_raises, backend="gloo", timeout_s=60, failure_grace_s=1.0)
    e = ei.value
    assert not isinstance(e, CollectiveMismatch)
    assert list(e.failures) == [1]
    assert "Traceback" in e.failures[1] and "ValueError: planted failure on rank 1" in e.failures[1]
    assert "in _rank1_raises" in e.failures[1]
    msg = str(e)
    assert msg.startswith("rank(s) 1 failed")
    assert "rank 1: failed: ValueError: planted failure on rank 1" in msg
    assert "rank 0: stuck in all_reduce(group=world, shape=(2,), dtype=float32) [collective #0, entered]" in msg
    assert time.monotonic() - t0 < 30  # grace, not the 60 s timeout


def _skip_everywhere(comm):
    raise RankSkip(f"no widget on rank {comm.rank}")


def test_rank_skip_becomes_launch_skipped():
    with pytest.raises(LaunchSkipped) as ei:
        launch(TP2, _skip_everywhere, backend="gloo", timeout_s=60)
    assert ei.value.reason.startswith("rank 0: no widget on rank 0")
    assert ei.value.ranks == (0, 1)
    assert ei.value.exit_codes == {0: SKIP_EXIT_CODE, 1: SKIP_EXIT_CODE}


def _sleep(comm, s):
    time.sleep(s)


def test_parent_interrupt_leaves_no_child(monkeypatch):
    real = supervisor.decode_message

    def interrupted(data):
        msg = real(data)
        if msg[0] == "ready":
            raise KeyboardInterrupt
        return msg

    monkeypatch.setattr(supervisor, "decode_message", interrupted)
    with pytest.raises(KeyboardInterrupt):
        launch(TP2, _sleep, 120, backend="gloo", timeout_s=300)
    # the autouse fixture asserts that no child survived


def test_launch_rejects_unpicklable_fn_before_spawning():
    with pytest.raises(TypeError, match="module-level"):
        launch(TP2, lambda comm: None, backend="gloo")


def test_backend_and_child_env():
    have = torch.cuda.is_available() and len(worker_gpus()) >= 2
    assert launcher.resolve_backend("auto", 2) == ("nccl" if have else "gloo")
    assert launcher.resolve_backend("GLOO", 2) == "gloo"
    if not have:
        with pytest.raises(LaunchSkipped, match="nccl needs 2 GPUs"):
            launcher.resolve_backend("nccl", 2)
    with pytest.raises(ValueError):
        launcher.resolve_backend("mpi", 2)
    env = launcher.child_env(1, 4, "nccl", "/tmp/hb", 1)
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "4" and env["LOCAL_RANK"] == "1"
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert env["SPECHARNESS_HEARTBEAT_FILE"] == "/tmp/hb" and env["SPECHARNESS_CUDA_DEVICE"] == "1"



def _env_and_parent(comm, names, launcher_pid):
    return {n: os.environ.get(n) for n in names} | {"RANK": os.environ["RANK"], "parent": os.getppid() == launcher_pid}


def test_gloo_ranks_see_the_launching_process_environment_not_the_forkservers(monkeypatch):
    """The forkserver keeps the environment it started with; each rank must see its parent's as it is at launch."""
    launcher.launch(ParallelLayout(tp_size=2), _sleep, 0.0, backend="gloo")  # the server is running from here on
    monkeypatch.setenv("SPECHARNESS_TEST_SET_LATE", "yes")
    monkeypatch.delenv("HOME", raising=False)
    out = launcher.launch(ParallelLayout(tp_size=2), _env_and_parent, ("SPECHARNESS_TEST_SET_LATE", "HOME"), os.getpid(), backend="gloo")
    assert out.results == [{"SPECHARNESS_TEST_SET_LATE": "yes", "HOME": None, "RANK": str(r), "parent": False} for r in range(2)]
