"""Hypothesis strategies: layouts (every branch), specs, schedules with idle DP groups."""
from __future__ import annotations

from hypothesis import strategies as st

from harness.run.layouts import all_layouts, deployed_layouts
from runners.config import SpecConfig
from runners.parallel.layout import ParallelLayout

LAYOUTS = all_layouts() + deployed_layouts()  # world 1..8, then the multi-node DP-attention worlds 16..64


def layouts(max_world: int = 8, min_world: int = 1) -> st.SearchStrategy[ParallelLayout]:
    """Every reachable layout with min_world <= world size <= max_world (shrinks toward the smallest world)."""
    chosen = [layout for layout in LAYOUTS if min_world <= layout.world_size <= max_world]
    if not chosen:
        raise ValueError(f"no reachable layout with world size in {min_world}..{max_world}")
    return st.sampled_from(chosen)


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


# ----------------------------------------------------------------------------------------
# From failure to case (issue 7): a failing example becomes a ready case file
# ----------------------------------------------------------------------------------------
# Inside a @given test, wrap the property's assertion:
#
#     with failure_case(layout, spec, schedule, seed, prop="P1"):
#         assert verdict, verdict.report()
#
# On failure (an assertion or a crash) the example is written to out/failures/failure_<test>.toml
# (or $SPECHARNESS_FAILURE_DIR) and the path, the `harness replay` command and an @example line
# are appended to the failure message (exception notes). Hypothesis' shrink passes overwrite the one
# file; its final replay of the minimal example writes last, so the file holds the shrunk example.
import contextlib  # noqa: E402
from typing import Iterator, Optional, Sequence  # noqa: E402

from harness.cases.template import example_snippet, failure_note, write_failure_case  # noqa: E402,F401


@contextlib.contextmanager
def failure_case(layout: Optional[ParallelLayout] = None, spec: Optional[SpecConfig] = None, schedule: Optional[Sequence[Sequence[int]]] = None,
                 seed: int = 0, *, prop: Optional[str] = None, **kwargs) -> Iterator[None]:
    """Write the example as a case file when the body raises; re-raise with the path in the message.

    kwargs go to write_failure_case (scenario=, model=, prefix_lens=, accept_lens=, name=, directory=).
    """
    from hypothesis.errors import Frozen, UnsatisfiedAssumption

    try:
        yield
    except (UnsatisfiedAssumption, Frozen):  # assume() / data.draw after the end: hypothesis' control flow, not a failure
        raise
    except Exception as e:
        path = write_failure_case(layout, spec, schedule, seed, prop=prop, message=str(e), **kwargs)
        sc = kwargs.get("scenario")
        lay, sp = (sc.layout, sc.spec) if sc is not None else (layout, spec)
        sched = [it.dp_batch_sizes for it in sc.iterations] if sc is not None else schedule
        e.add_note(failure_note(path, lay, sp, sched, sc.seed if sc is not None else seed))
        raise
