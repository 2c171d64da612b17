"""What the simulated-rank test files share: the layouts they run, and the autouse check that no rank
thread outlives a test."""
from __future__ import annotations

import threading

import pytest

from runners.parallel.comm import Group
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

# failures that need no deadline must be reported well within this: half the 30 s deadline the failure tests run
# under, so a report that waited for the deadline fails it while a loaded machine's slower report does not
FAST_S = 15.0


def sim_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("simrank-")]


@pytest.fixture(autouse=True)
def no_thread_leak():
    # compare thread sets, not counts: pytest-timeout's timer thread may end between setup and teardown
    before = set(threading.enumerate())
    yield
    assert sim_threads() == [], "simulated-rank threads still alive after the test"
    assert set(threading.enumerate()) - before == set()


