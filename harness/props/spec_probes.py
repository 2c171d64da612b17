"""The probes that run P2 / P5 / P6 / P8 for `harness mutants` and `harness check --props all`."""

from typing import Callable, Sequence

from harness.case import load_case
from harness.crash import crash_verdict
from harness.props.p2 import check_padded_lanes
from harness.props.p5_p6 import check_agreeing_draft, check_spec_case
from harness.props.p8 import ChurnPair
from harness.ranks.simulated import RankFailure
from harness.spec_decode import (
    Workload,
)
from harness.verdict import Verdict, merge_verdicts
from runners.config import SpecConfig
from runners.parallel.layout import ParallelLayout

# ----------------------------------------------------------------------------------------
# probes for `harness mutants` (each a few seconds on 2 cores)
# ----------------------------------------------------------------------------------------

PROBE_SPEC_CASES = ("tp1_neither", "tp4_attn_tp_gather", "tp4_neither_topk2", "tp2_page4_shrink", "tp2_page4_tree")
# The eager runner only: under DP attention only an eager pass is MLP-sync padded (runners.mlp_sync),
# a verify batch in whole trees; a graph replay pads to its bucket instead. Uneven groups, one idle at the end.
PROBE_DP_EAGER_CASES = ("tp2_dp2_mlp_tp_gather",)
P2_CASES = ("tp2_shrink", "tp4_dp2_mlp_tp_gather", "tp2_page4_tree", "tp2_single_layer_shrink")  # the last: the draft-decode runner at TP2
CHURN_SPEC = SpecConfig(num_steps=3, topk=1, capture_bs=(1, 2, 4, 8), max_running_requests=8)
# Fixed schedules crossing every bucket boundary (8 -> 4 -> 2 -> 1 and back) with a preemption;
# (rule, dp_group, arg). The DP one keeps the groups uneven and idles each group once.
CHURN_SCRIPT: tuple[tuple, ...] = (
    ("add", 0, 3), ("step",), ("add", 0, 4), ("step",), ("step",),  # 3 (bucket 4), then 7 (bucket 8)
    ("finish", 0, 0), ("finish", 0, 0), ("step",),  # 5 in bucket 8: padded lanes 5, 6 held requests now at lanes 3, 4
    ("finish", 0, 0), ("finish", 0, 1), ("step",),  # 3 in bucket 4: lane 3 stale, its request alive at lane 1
    ("preempt", 0, 0), ("step",), ("resume", 0), ("add", 0, 3), ("step",),  # 2, then the preempted one back and 6
    ("finish", 0, 1), ("finish", 0, 1), ("finish", 0, 1), ("step",), ("step",),  # 3 in bucket 4 again
    ("finish", 0, 0), ("step",), ("add", 0, 1), ("step",),
)
CHURN_SCRIPT_DP2: tuple[tuple, ...] = (  # two DP groups, uneven, each idle at some point (MLP-TP gather: one bucket for both)
    ("add", 0, 3), ("step",), ("add", 0, 4), ("add", 1, 2), ("step",),
    ("finish", 0, 0), ("finish", 0, 0), ("finish", 1, 0), ("step",),
    ("finish", 0, 0), ("finish", 0, 1), ("add", 1, 2), ("step",),
    ("preempt", 0, 0), ("finish", 1, 0), ("step",), ("resume", 0), ("add", 0, 2), ("step",),
    ("finish", 0, 1), ("finish", 0, 1), ("finish", 1, 0), ("step",), ("finish", 1, 0), ("step",), ("step",),
)
# The single-layer draft (draft-extend, then the graphed draft decode), topk 2: a tree whose lanes the buckets pad.
CHURN_DECODE_SPEC = SpecConfig(num_steps=3, topk=2, capture_bs=(1, 2, 4, 8), max_running_requests=8, draft="single_layer")
CHURN_RUNS = ((ParallelLayout(), CHURN_SCRIPT, CHURN_SPEC), (ParallelLayout(tp_size=2, dp_size=2, enable_dp_attention=True), CHURN_SCRIPT_DP2, CHURN_SPEC),
              (ParallelLayout(), CHURN_SCRIPT, CHURN_DECODE_SPEC))


def run_churn_script(layout: ParallelLayout, script: Sequence[tuple], spec: SpecConfig = CHURN_SPEC) -> dict[str, Verdict]:
    try:
        pair = ChurnPair(layout, spec)
        for name, *args in script:
            getattr(pair, name)(*args)
    except RankFailure as err:
        return {"run": crash_verdict("run", {"layout": layout.describe(), "probe": "P8 churn"}, err)}
    return {"P8": pair.finish_check()}


def _guarded(name: str, fn: Callable[[], dict[str, Verdict]]) -> Callable[[], dict[str, Verdict]]:
    """A probe never raises: an exception anywhere (a rank, the oracle, the harness) is a "run" failure."""

    def probe() -> dict[str, Verdict]:
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - reported, never swallowed
            return {"run": crash_verdict("run", {"probe": name}, err)}

    probe.__name__ = f"probe_{name.replace('-', '_')}"
    return probe


AGREE_RUNS = (  # P5's positive control: plain TP (tree with topk 2) and an MLP-TP-gather DP layout
    (ParallelLayout(tp_size=2), SpecConfig(num_steps=2, topk=2, capture_bs=(1, 2, 4, 8), max_running_requests=8), Workload(((3,), (5,), (2,)), 2)),
    (ParallelLayout(tp_size=2, dp_size=2, enable_dp_attention=True), SpecConfig(num_steps=3, topk=1, capture_bs=(1, 2, 4, 8), max_running_requests=8),
     Workload(((2, 1), (3, 0), (1, 2)), 2)),
)


def _spec_cases() -> dict[str, Verdict]:
    """P5 and P6 (graph runner) over the probe cases, (eager runner) over the DP ones; the agreeing draft (P5) on two layouts."""
    out: dict[str, Verdict] = {}
    for name in PROBE_SPEC_CASES:
        merge_verdicts(out, check_spec_case(load_case(name), runners=("graph",)))
    for name in PROBE_DP_EAGER_CASES:
        merge_verdicts(out, check_spec_case(load_case(name), runners=("eager",)))
    for layout, spec, wl in AGREE_RUNS:
        merge_verdicts(out, check_agreeing_draft(layout, spec, wl))
    return out


def _padded_lanes() -> dict[str, Verdict]:
    out: dict[str, Verdict] = {}
    for name in P2_CASES:
        merge_verdicts(out, check_padded_lanes(load_case(name)))
    return out


def _churn() -> dict[str, Verdict]:
    out: dict[str, Verdict] = {}
    for layout, script, spec in CHURN_RUNS:
        merge_verdicts(out, run_churn_script(layout, script, spec))
    return out


probe_spec_cases = _guarded("spec-cases", _spec_cases)
probe_padded_lanes = _guarded("padded-lanes", _padded_lanes)
probe_churn = _guarded("batch-churn", _churn)

# One run each, for the replay-fill mutants (harness.mutants.replay_fill): what a single fill line breaks shows in one
# small run, so a mutant per line stays cheap. P8 on the single-layer draft at TP1 replays every runner but the
# multi-layer one (draft-extend, draft decode, verify) eager and graph side by side; P2 on a shrinking case checks
# the canonical fill of the padded lanes of its draft-extend and verify runners.
probe_churn_single_layer = _guarded("churn-single-layer", lambda: run_churn_script(*CHURN_RUNS[2]))
probe_padded_lanes_multi_layer = _guarded("padded-lanes-multi-layer", lambda: check_padded_lanes(load_case("tp2_shrink")))
probe_padded_lanes_single_layer = _guarded("padded-lanes-single-layer", lambda: check_padded_lanes(load_case("tp2_single_layer_shrink")))

SPEC_PROBES = (("spec-cases", probe_spec_cases), ("padded-lanes", probe_padded_lanes), ("batch-churn", probe_churn))
FILL_PROBES = (("churn-single-layer", probe_churn_single_layer), ("padded-lanes-multi-layer", probe_padded_lanes_multi_layer),
               ("padded-lanes-single-layer", probe_padded_lanes_single_layer))
