"""Hypothesis strategies: layouts (every branch), specs, schedules with idle DP groups."""
from __future__ import annotations

from hypothesis import strategies as st

from harness.layout import all_layouts
from runners.config import SpecConfig
from runners.parallel.layout import ParallelLayout

LAYOUTS = all_layouts()


def layouts(max_world: int = 8) -> st.SearchStrategy[ParallelLayout]:
    return st.sampled_from([layout for layout in LAYOUTS if layout.world_size <= max_world])


@st.composite
def specs(draw, max_steps: int = 3, max_topk: int = 3) -> SpecConfig:
    steps = draw(st.integers(1, max_steps))
    extra = draw(st.integers(0, 1))  # num_tokens_per_bs may exceed num_steps + 1
    capture = tuple(sorted(set(draw(st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]), min_size=1, max_size=5)))))
    return SpecConfig(
        num_steps=steps,
        topk=draw(st.integers(1, max_topk)),
        num_draft_tokens=steps + 1 + extra,
        capture_bs=capture,
        max_running_requests=draw(st.sampled_from([8, 12, 16])),
    )


@st.composite
def schedules(draw, layout: ParallelLayout, max_bs: int, max_iterations: int = 3) -> list[tuple[int, ...]]:
    """Per iteration, each DP group's raw bs; idle groups (0) allowed when DP attention is on."""
    dp = layout.attn_dp_size
    lo = 0 if dp > 1 else 1
    out = []
    for _ in range(draw(st.integers(1, max_iterations))):
        row = tuple(draw(st.integers(lo, max_bs)) for _ in range(dp))
        if sum(row) == 0:
            row = (1,) + row[1:]
        out.append(row)
    return out
