"""Rank threads run on one CPU: those started inside threads_on_one_cpu() keep it, and nothing else does."""
from __future__ import annotations

import os
import threading

import pytest

from harness.engines.vllm.standins import DPWorld
from harness.ranks import one_cpu
from harness.ranks.one_cpu import current_cpu, threads_on_one_cpu
from harness.ranks.simulated import SimulatedWorld
from runners.parallel.layout import ParallelLayout

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs per-thread CPU affinity (Linux) and a process allowed on two CPUs or more")


def _affinity_of_a_new_thread() -> set[int]:
    seen: list[set[int]] = []
    t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
    t.start()
    t.join()
    return seen[0]


def test_threads_started_inside_keep_one_cpu_and_the_caller_gets_its_cpus_back():
    allowed = os.sched_getaffinity(0)
    assert current_cpu() in allowed
    with threads_on_one_cpu():
        inside = _affinity_of_a_new_thread()
    assert len(inside) == 1 and inside <= allowed
    assert os.sched_getaffinity(0) == allowed
    assert _affinity_of_a_new_thread() == allowed


def test_the_caller_gets_its_cpus_back_when_the_block_raises():
    allowed = os.sched_getaffinity(0)
    with pytest.raises(ValueError), threads_on_one_cpu():
        raise ValueError
    assert os.sched_getaffinity(0) == allowed


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


def test_every_simulated_rank_and_every_vllm_dp_rank_runs_on_the_same_one_cpu():
    allowed = os.sched_getaffinity(0)
    ranks = SimulatedWorld(ParallelLayout(tp_size=8)).run(lambda comm: frozenset(os.sched_getaffinity(0)))
    assert len(set(ranks)) == 1 and len(ranks[0]) == 1 and ranks[0] <= allowed
    dp_ranks = DPWorld(4).run(lambda rank: frozenset(os.sched_getaffinity(0)))
    assert len(set(dp_ranks)) == 1 and len(dp_ranks[0]) == 1
    assert os.sched_getaffinity(0) == allowed
