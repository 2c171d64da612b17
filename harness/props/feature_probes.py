"""The probes of the loop's features that a case enables (logprobs, mixed DP modes, the overlap scheduler): one shipped
case each through the loop, for `harness mutants`. Each a few seconds on 2 cores; a mutant names the one it needs."""
from __future__ import annotations

from harness.case import load_case
from harness.props.p5_p6 import check_spec_case
from harness.props.spec_probes import _guarded
from harness.verdict import Verdict

LOGPROB_CASE = "tp2_dp2_logprobs"


def _logprob_case() -> dict[str, Verdict]:
    """P3 (the draft graphs replayed every batch), P5 (logprobs against the oracle), P6 (the logprob golden), graph runner."""
    return check_spec_case(load_case(LOGPROB_CASE), runners=("graph",))


probe_logprob_case = _guarded("logprob-case", _logprob_case)

FEATURE_PROBES = (("logprob-case", probe_logprob_case),)
