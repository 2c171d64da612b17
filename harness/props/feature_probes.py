"""The probes of the loop's features that a case enables (logprobs, mixed DP modes, the overlap scheduler): the feature's
shipped case through the loop with the graph runner (its decode steps replay graphs), for `harness mutants`. Each a few
seconds on 2 cores; a mutant names the one it needs.

A run whose ranks did not finish (a collective desync between DP groups, a rank that raised) is a P7 failure here, as
the idle-rank probe reports one: P7 is the property that every rank issues the same collectives and completes."""
from __future__ import annotations

from harness.case import load_case
from harness.props.p5_p6 import check_spec_case
from harness.props.spec_probes import _guarded
from harness.verdict import Failure, Verdict

LOGPROB_CASE = "tp2_dp2_logprobs"
MIXED_MODES_CASE = "tp3_dp3_mixed_modes"
OVERLAP_CASE = "tp2_dp2_overlap"


def _loop_case(name: str) -> dict[str, Verdict]:
    """P3 (graphs replayed; logprobs: the draft graphs replayed every batch), P5 (tokens and logprobs against the
    oracle), P6 (the acceptance and logprob goldens), P7 (mixed modes: every step's collectives)."""
    out = check_spec_case(load_case(name), runners=("graph",))
    run = out.pop("run", None)
    if run is not None:
        p7 = out.setdefault("P7", Verdict("P7"))
        p7.checked += run.checked
        p7.failures += [Failure("P7", "run", f.field, f.where, f.expected, f.got, f.detail) for f in run.failures]
    return out


probe_logprob_case = _guarded("logprob-case", lambda: _loop_case(LOGPROB_CASE))
probe_mixed_modes_case = _guarded("mixed-modes-case", lambda: _loop_case(MIXED_MODES_CASE))
probe_overlap_case = _guarded("overlap-case", lambda: _loop_case(OVERLAP_CASE))

FEATURE_PROBES = (("logprob-case", probe_logprob_case), ("mixed-modes-case", probe_mixed_modes_case), ("overlap-case", probe_overlap_case))
