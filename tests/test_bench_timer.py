"""harness bench's timer: eager and graph measured in alternating blocks, so that a machine whose speed
drifts during the measurement slows both alike. A fake clock makes the drift exact (no timed assertion)."""
from __future__ import annotations

import statistics

import torch

from harness.bench import timer as bench_timer
from harness.bench.timer import INTERLEAVE_BLOCKS, Timer


class _DriftingMachine:
    """A clock read by perf_counter; each call of a job costs its work times a slowdown that grows per call."""

    def __init__(self) -> None:
        self.now, self.slowdown, self.calls = 0.0, 1.0, []

    def clock(self) -> float:
        return self.now

    def job(self, name: str, work: float):
        def run() -> None:
            self.calls.append(name)
            self.now += work * self.slowdown
            self.slowdown += 0.005  # the machine ends ~2.4x slower than it starts
        return run


def test_interleaved_blocks_keep_the_ratio_under_drift(monkeypatch):
    m = _DriftingMachine()
    monkeypatch.setattr(bench_timer.time, "perf_counter", m.clock)
    timer = Timer(torch.device("cpu"))
    eager, graph = timer.measure_interleaved([m.job("eager", 10.0), m.job("graph", 1.0)], reps=50, warmup=5)
    assert len(eager) == len(graph) == 50
    assert abs(statistics.median(eager) / statistics.median(graph) - 10.0) < 0.5  # within 5%

    # the same jobs measured one after the other, as before: the drift lands on the second
    m2 = _DriftingMachine()
    monkeypatch.setattr(bench_timer.time, "perf_counter", m2.clock)
    e2 = timer.measure(m2.job("eager", 10.0), 50, 5)
    g2 = timer.measure(m2.job("graph", 1.0), 50, 5)
    assert statistics.median(e2) / statistics.median(g2) < 8.5  # off by more than 15%


def test_interleaved_blocks_alternate_abba_with_one_untimed_call_each(monkeypatch):
    m = _DriftingMachine()
    monkeypatch.setattr(bench_timer.time, "perf_counter", m.clock)
    Timer(torch.device("cpu")).measure_interleaved([m.job("a", 1.0), m.job("b", 1.0)], reps=10, warmup=2)
    block = -(-10 // INTERLEAVE_BLOCKS)
    a, b = ["a"] * (1 + block), ["b"] * (1 + block)
    expected = ["a"] * 2 + ["b"] * 2 + [c for r in range(INTERLEAVE_BLOCKS) for c in (a + b if r % 2 == 0 else b + a)]
    assert m.calls == expected
