"""Rank threads and the machine's CPUs: those started inside threads_on_one_cpu() keep one CPU, and nothing else does;
each runs torch on its caller's one thread from its first op."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from harness.engines.vllm.standins import DPWorld
from harness.ranks import one_cpu
from harness.ranks.one_cpu import current_cpu, threads_on_one_cpu
from harness.ranks.simulated import SimulatedWorld, one_torch_thread
from runners.parallel.layout import ParallelLayout

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs per-thread CPU affinity (Linux) and a process allowed on two CPUs or more")
two_cores = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="MKL splits a matmul over threads only on two cores or more")


def _affinity_of_a_new_thread() -> set[int]:
    seen: list[set[int]] = []
    t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
    t.start()
    t.join()
    return seen[0]


@needs_affinity
def test_threads_started_inside_keep_one_cpu_and_the_caller_gets_its_cpus_back():
    allowed = os.sched_getaffinity(0)
    assert current_cpu() in allowed
    with threads_on_one_cpu():
        inside = _affinity_of_a_new_thread()
    assert len(inside) == 1 and inside <= allowed
    assert os.sched_getaffinity(0) == allowed
    assert _affinity_of_a_new_thread() == allowed


@needs_affinity
def test_the_caller_gets_its_cpus_back_when_the_block_raises():
    allowed = os.sched_getaffinity(0)
    with pytest.raises(ValueError), threads_on_one_cpu():
        raise ValueError
    assert os.sched_getaffinity(0) == allowed


@needs_affinity
def test_without_proc_the_cpu_is_picked_by_pid(monkeypatch):
    """A sandbox without /proc/thread-self: the threads still share one CPU, the pid's among the allowed ones."""

    def no_proc(*_a, **_k):
        raise FileNotFoundError("/proc/thread-self/stat")

    monkeypatch.setattr(one_cpu, "open", no_proc, raising=False)
    assert current_cpu() is None
    allowed = sorted(os.sched_getaffinity(0))
    with threads_on_one_cpu():
        inside = _affinity_of_a_new_thread()
    assert inside == {allowed[os.getpid() % len(allowed)]}


@needs_affinity
def test_every_simulated_rank_and_every_vllm_dp_rank_runs_on_the_same_one_cpu():
    allowed = os.sched_getaffinity(0)
    ranks = SimulatedWorld(ParallelLayout(tp_size=8)).run(lambda comm: frozenset(os.sched_getaffinity(0)))
    assert len(set(ranks)) == 1 and len(ranks[0]) == 1 and ranks[0] <= allowed
    dp_ranks = DPWorld(4).run(lambda rank: frozenset(os.sched_getaffinity(0)))
    assert len(set(dp_ranks)) == 1 and len(dp_ranks[0]) == 1
    assert os.sched_getaffinity(0) == allowed


# a matmul MKL splits over its threads on two cores: the sum's order shows in the last bits
FIRST_MATMUL = (torch.arange(2 * 4096, dtype=torch.float32).reshape(2, 4096).sin(),
                torch.arange(4096 * 256, dtype=torch.float32).reshape(4096, 256).cos())


@two_cores
def test_a_ranks_first_matmul_sums_as_on_one_thread():
    """MKL's thread count is per thread: a rank thread's matmul before its first parallel op split over every core."""
    a, b = FIRST_MATMUL
    with one_torch_thread():
        one_thread = a @ b
    for out in SimulatedWorld(ParallelLayout(tp_size=2)).run(lambda comm: a @ b):
        assert torch.equal(out, one_thread)


@two_cores
def test_dp_world_ranks_run_their_first_matmul_on_the_callers_thread_count():
    """The same for a vLLM check's DP ranks, which run under the check's one thread (harness/engines/vllm/command.py)."""
    a, b = FIRST_MATMUL
    with one_torch_thread():
        one_thread = a @ b
        outs = DPWorld(2).run(lambda rank: a @ b)
    assert all(torch.equal(o, one_thread) for o in outs)
