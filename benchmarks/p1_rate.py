"""Examples per second of the P1 metadata property (the issue asks >= 200/s).

An example = one (layout, spec, schedule) drawn by harness.run.strategies, checked on every
graph runner (each multi-layer step + the single-layer one) of one rank per DP group, at
every iteration of the schedule, plus the branch-parity sibling.

    python benchmarks/p1_rate.py [--examples 500]
"""
import argparse
import platform
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.props.p1_metadata import check_metadata
from harness.run.strategies import layouts, schedules, specs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=500)
    args = ap.parse_args()
    drawn = []

    @st.composite
    def ex(draw):
        layout = draw(layouts())
        spec = draw(specs())
        return layout, spec, draw(schedules(layout, max_bs=spec.max_running_requests))

    @settings(max_examples=args.examples, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(ex())
    def collect(e):
        drawn.append(e)

    collect()
    t0 = time.perf_counter()
    checks = 0
    for layout, spec, schedule in drawn:
        v = check_metadata(layout, spec, schedule)
        assert v, v.report()
        checks += v.checked
    dt = time.perf_counter() - t0
    print(f"P1 metadata: {len(drawn)} examples, {checks} invariant checks in {dt:.2f}s = {len(drawn) / dt:.0f} examples/s, "
          f"{checks / dt:.0f} checks/s ({platform.processor() or platform.machine()}, torch CPU, 1 thread of work)")


if __name__ == "__main__":
    main()
