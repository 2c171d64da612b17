"""The probes that run the properties over the shipped cases of the attention backends other than the reference:
torch_planned (flashinfer's host plan in torch ops) and triton (its kernels, in the interpreter on CPU). The
torch-backend probes (harness.suite, harness.props.spec_probes) never reach their plan or their kernels."""

from harness.case import load_case
from harness.checks import check_case
from harness.props.p2 import check_padded_lanes
from harness.props.p5_p6 import check_spec_case
from harness.props.spec_probes import _guarded
from harness.verdict import Verdict, merge_verdicts

PLANNED_CASES = ("tp2_planned_shrink", "tp1_planned_single_layer")  # multi-layer (steps planned once) and the draft decode
TRITON_P2_CASE = "tp1_triton_shrink"


def _planned_cases() -> dict[str, Verdict]:
    """P1, P3 and P4 over the torch_planned cases: every replay planned from its own buffers, against the eager passes."""
    out: dict[str, Verdict] = {}
    for name in PLANNED_CASES:
        merge_verdicts(out, check_case(load_case(name)).verdicts)
    return out


def _planned_loop() -> dict[str, Verdict]:
    """P5 (and the verify runner's P1/P3) through the loop on the torch_planned cases: prompt prefills eager, every
    runner graphed, on one backend per engine."""
    out: dict[str, Verdict] = {}
    for name in PLANNED_CASES:
        merge_verdicts(out, check_spec_case(load_case(name), runners=("graph",), props=("P5",)))
    return out


probe_planned_cases = _guarded("planned-cases", _planned_cases)
probe_planned_loop = _guarded("planned-loop", _planned_loop)
probe_padded_lanes_triton = _guarded("padded-lanes-triton", lambda: check_padded_lanes(load_case(TRITON_P2_CASE)))

BACKEND_PROBES = (("planned-cases", probe_planned_cases), ("planned-loop", probe_planned_loop),
                  ("padded-lanes-triton", probe_padded_lanes_triton))
