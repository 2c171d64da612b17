"""How fast this machine runs two fixed workloads now: the yardstick a CI time is read against.

On a shared host the suite's time can grow several-fold while the load average stays where it was: what a neighbour
takes is memory bandwidth and cache, which the load average does not show, and the suite leans on both (the
interpreter walking a heap of millions of objects, torch allocating and gathering). So `.ci/run` prints these figures
at its start and at its end: a run whose phases grew several-fold with these figures was a slow machine. The figures
are coarse: the same code's suite also moves from run to run while they hold steady, so only a change well past
that spread, beside steady figures, points at the code.

The workloads never change (a changed workload would be a new yardstick, not a faster machine) and use the standard
library alone (no torch import to pay). Each stands for one thing the suite leans on: interpreted Python over a heap
far past the CPU's caches (a dict of 300,000 entries built, then read at every key in a scattered order: memory
latency) and one large copy (memory bandwidth). Each figure is the median of a few rounds.

    python benchmarks/machine_speed.py [--rounds 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

PYTHON_ITEMS = 300_000
STRIDE = 7919  # prime, not a divisor of PYTHON_ITEMS: i * STRIDE % PYTHON_ITEMS visits every key once, scattered
COPY_BYTES = 32 << 20  # one buffer this size, far past any CPU cache, copied COPIES times per round
COPIES = 8


def python_round() -> int:
    table = {i: (i, str(i)) for i in range(PYTHON_ITEMS)}
    return sum(table[i * STRIDE % PYTHON_ITEMS][0] for i in range(PYTHON_ITEMS))


def copy_round(src: bytearray, dst: bytearray) -> None:
    for _ in range(COPIES):
        dst[:] = src  # same length: a memcpy into the pages dst already has


def median_s(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(rounds: int) -> dict[str, float]:
    src, dst = bytearray(b"\x01") * COPY_BYTES, bytearray(COPY_BYTES)  # both written once here: the rounds fault no page
    copy_s = median_s(lambda: copy_round(src, dst), rounds)
    return {"python_s": round(median_s(python_round, rounds), 3),
            "copy_gb_s": round(2 * COPY_BYTES * COPIES / copy_s / 1e9, 2)}  # bytes read and written per second


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of each workload; the median counts (default 3)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1 (got {args.rounds})")
    m = measure(args.rounds)
    if args.json:
        print(json.dumps(m))
    else:
        print(f"machine speed: python over a large heap {m['python_s']:.2f} s (lower is faster), "
              f"memory copy {m['copy_gb_s']:.1f} GB/s (higher is faster)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
