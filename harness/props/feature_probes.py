"""The probes of the loop's features that a case enables (logprobs, mixed DP modes, the overlap scheduler): one shipped
case each through the loop, for `harness mutants`. Each a few seconds on 2 cores; a mutant names the one it needs."""
from __future__ import annotations

from harness.case import load_case
from harness.golden.acceptance import AcceptanceGoldenError, load_acceptance_golden
from harness.p7 import run_verdict
from harness.props.mixed_modes import check_mixed_modes
from harness.props.p5_p6 import check_lossless, check_spec_case, compare_acceptance
from harness.props.spec_probes import _guarded
from harness.ranks.simulated import RankFailure
from harness.spec_decode import case_session
from harness.verdict import Verdict

LOGPROB_CASE = "tp2_dp2_logprobs"
MIXED_MODES_CASE = "tp3_dp3_mixed_modes"
OVERLAP_CASE = "tp2_dp2_overlap"


def _logprob_case() -> dict[str, Verdict]:
    """P3 (the draft graphs replayed every batch), P5 (logprobs against the oracle), P6 (the logprob golden), graph runner."""
    return check_spec_case(load_case(LOGPROB_CASE), runners=("graph",))


def _mixed_modes_case() -> dict[str, Verdict]:
    """P7 (every step's collectives agree; a desync is a P7 run failure, as the idle-rank probe reports it), P5, P6
    (acceptance golden), graph runner: its decode steps replay graphs, its mixed steps must not."""
    case = load_case(MIXED_MODES_CASE)
    where = {"case": case.name, "layout": case.layout.describe(), "runner": "graph"}
    try:
        s = case_session(case, "graph")
    except RankFailure as err:
        return {"P7": run_verdict(case.scenario, err, "sim")}
    out = {"P7": check_mixed_modes(s, where), "P5": check_lossless(s, where), "P6": Verdict("P6")}
    try:
        compare_acceptance(out["P6"], load_acceptance_golden(case), s, where)
    except AcceptanceGoldenError as e:
        out["P6"].fail("golden", "file", where, "a golden for this case", "none usable", str(e))
    return out


def _overlap_case() -> dict[str, Verdict]:
    """P5 (the committed tokens are target greedy's), P6 (acceptance golden), P3 (graphs replayed), graph runner."""
    return check_spec_case(load_case(OVERLAP_CASE), runners=("graph",))


probe_logprob_case = _guarded("logprob-case", _logprob_case)
probe_mixed_modes_case = _guarded("mixed-modes-case", _mixed_modes_case)
probe_overlap_case = _guarded("overlap-case", _overlap_case)

FEATURE_PROBES = (("logprob-case", probe_logprob_case), ("mixed-modes-case", probe_mixed_modes_case), ("overlap-case", probe_overlap_case))
