"""How `harness bench` times: per repetition (CUDA events on a GPU, perf_counter on CPU), eager and graph in alternating
blocks so a machine whose speed drifts slows both alike, min / median / max of each measurement, and a warning when the
CPU is shared with other processes (the numbers of a loaded machine are not to be compared)."""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Optional

import torch

INTERLEAVE_BLOCKS = 5  # eager-vs-graph measurements alternate in this many blocks each (Timer.measure_interleaved)
LOADED_PER_CORE = 0.75  # a 1-minute load average above this per core: other processes share the CPU, timings are perturbed


class Timer:
    """Per-repetition times in ms: CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def measure(self, fn: Callable[[], object], reps: int, warmup: int) -> list[float]:
        for _ in range(warmup):
            fn()
        if self.cuda:
            torch.cuda.synchronize()
            pairs = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                pairs.append((a, b))
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in pairs]
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    def measure_interleaved(self, fns: list[Callable[[], object]], reps: int, warmup: int) -> list[list[float]]:
        """`measure` of each fn, in alternating blocks (one untimed call first in each), the order reversed every round
        (ABBA): a machine whose speed drifts during the measurement (the host's share of a shared box) slows every fn
        alike, so their ratio holds."""
        for fn in fns:
            for _ in range(warmup):
                fn()
        out: list[list[float]] = [[] for _ in fns]
        block, rounds = -(-reps // INTERLEAVE_BLOCKS), 0
        while len(out[0]) < reps:
            pairs = list(zip(out, fns, strict=True))
            for times, fn in pairs if rounds % 2 == 0 else reversed(pairs):
                times += self.measure(fn, min(block, reps - len(times)), 1)
            rounds += 1
        return out

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def spread(times: list[float]) -> dict[str, float]:
    """min / median / max of one measurement's repetitions (ms)."""
    return {"min": min(times), "median": statistics.median(times), "max": max(times)}


def load_warning(device: torch.device) -> Optional[str]:
    """On CPU: a warning when the 1-minute load average says other processes share the cores (None: idle enough)."""
    if device.type != "cpu" or not hasattr(os, "getloadavg"):
        return None
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load <= LOADED_PER_CORE * cores:
        return None
    return (f"warning: load average {load:.1f} on {cores} core(s): other processes share the CPU, so these timings are perturbed "
            "(the min..max spread shows how much); rerun on an idle machine for numbers to compare")
