"""The fast property probes that `harness mutants` (and `harness check`) run.

A probe returns {property: Verdict}. Issues that add properties register a probe here
under an id; a mutant runs every registered probe unless it names the ones that can see
it (Mutant.probes), and the kill report says which property and probe killed it.
"""
from __future__ import annotations

from typing import Callable

from harness.case import load_case
from harness.checks import check_case
from harness.decode_props import probe_draft_decode, probe_draft_decode_backends
from harness.layout import all_layouts
from harness.p7 import probe_idle_ranks
from harness.props.backend_probes import BACKEND_PROBES
from harness.props.draft_probes import DRAFT_PROBES
from harness.props.feature_probes import FEATURE_PROBES
from harness.props.p1_metadata import check_metadata
from harness.props.shape_probes import SHAPE_PROBES
from harness.props.spec_probes import FILL_PROBES, SPEC_PROBES
from harness.verdict import Verdict, merge_verdicts
from runners.config import SpecConfig
from runners.parallel.layout import ParallelLayout

Probe = Callable[[], dict[str, Verdict]]

# A shrink schedule with uneven DP groups: exercises every bucket boundary and stale lanes.
GRID_SCHEDULE = ((6, 3, 5, 1, 2, 4, 7, 8), (2, 1, 1, 0, 1, 2, 1, 3), (1, 2, 1, 1, 1, 1, 1, 1))


def probe_metadata_grid() -> dict[str, Verdict]:
    """P1 on every reachable layout (TP 1/2/4/8, every branch) with two spec shapes: chains, and trees of 3 verify
    tokens (the fewest that make a tree other than the chain: a stale padded tree mask then shows)."""
    v = Verdict("P1")
    trees = SpecConfig(num_steps=1, topk=2, num_draft_tokens=3, capture_bs=(1, 2, 4, 8, 16))
    for spec in (SpecConfig(num_steps=3, capture_bs=(1, 2, 4, 8), max_running_requests=8), trees):
        for layout in all_layouts():
            dp = layout.attn_dp_size
            schedule = [row[:dp] if dp > 1 else row[:1] for row in GRID_SCHEDULE]
            schedule = [s if sum(s) else (1,) + tuple(s[1:]) for s in schedule]
            v.merge(check_metadata(layout, spec, schedule))
    return {"P1": v}


# P1 in one run, for the mutants that any layout shows: every graph runner (trees of 3 tokens, a 2-step draft) on one
# gathered layout with DP groups, over the grid's schedule (a batch shrinks within a bucket). The grid is for the
# mutants that only other layouts show (buckets on attn-TP, the attn-TP-gather branch).
FILL_METADATA_SPEC = SpecConfig(num_steps=2, topk=2, num_draft_tokens=3, capture_bs=(1, 2, 4, 8), max_running_requests=8)
FILL_METADATA_LAYOUT = ParallelLayout(tp_size=2, dp_size=2, enable_dp_attention=True)


def probe_metadata_dp() -> dict[str, Verdict]:
    return {"P1": check_metadata(FILL_METADATA_LAYOUT, FILL_METADATA_SPEC, [row[:2] for row in GRID_SCHEDULE])}


def probe_case_tp1() -> dict[str, Verdict]:
    """P1, P3 and P4 over the smallest case: the multi-layer draft-extend runner, eager and graph."""
    return check_case(load_case("tp1_neither")).verdicts


def probe_case_one_graph() -> dict[str, Verdict]:
    """P1, P3 and P4 over the one-graph composite's case (a shrink: padded lanes in every bucket but the first)."""
    return check_case(load_case("tp2_shrink_one_graph")).verdicts


# The cases probe's cases: one per branch family plus the shrink and idle-rank
# schedules, world sizes 1..8, DP attention in every branch. `harness check` runs all shipped cases (world 16 and 32 too);
# the mutant run takes this subset: it is the costliest probe, so mutants list it last.
MUTANT_CASES = (
    "tp1_neither",
    "tp2_shrink",
    "tp2_dp2_mlp_dp_lm_head",
    "tp4_attn_tp_gather",
    "tp4_dp2_mlp_tp_gather",
    "tp4_dp2_attn_tp_gather",
    "tp8_dp4_mlp_idle_rank",
    "tp4_dp4_neither",  # DP attention without gathered counts: the eager pass must not be MLP-sync padded
)


def probe_cases() -> dict[str, Verdict]:
    """P1 (run path), P3 and P4 over MUTANT_CASES."""
    out: dict[str, Verdict] = {}
    for case in (load_case(name) for name in MUTANT_CASES):
        merge_verdicts(out, check_case(case).verdicts)
    return out


# Every probe, in the order a mutant without a probe list runs them (the costly ones moved last):
# P1 metadata grid, P1/P3/P4 cases, P7 idle ranks, P2/P5/P6/P8 over the loop, the draft decode, its kernels vs the reference;
# then the one-run probes the replay-fill mutants name (after the rest, so that a mutant without a list is killed where it was).
PROBES: list[tuple[str, Probe]] = [
    ("metadata-grid", probe_metadata_grid),
    ("cases", probe_cases),
    ("p7-idle-ranks", probe_idle_ranks),
    *SPEC_PROBES,
    ("draft-decode", probe_draft_decode),
    ("draft-decode-backends", probe_draft_decode_backends),
    ("metadata-dp", probe_metadata_dp),
    ("case-tp1", probe_case_tp1),
    *FILL_PROBES,
    ("case-one-graph", probe_case_one_graph),
    *DRAFT_PROBES,
    *FEATURE_PROBES,
    *SHAPE_PROBES,
    *BACKEND_PROBES,
]
if len({n for n, _ in PROBES}) != len(PROBES):
    raise ImportError("two probes share an id: " + ", ".join(n for n, _ in PROBES))
COSTLY_PROBES = ("cases",)  # run whole cases: a mutant without a probe list runs them after every other probe
