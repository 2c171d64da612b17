"""The probes of vLLM's padding convention and vLLM's shapes of the draft-extend (harness.mutants.vllm_shapes names
them): P1, P3 and P4 over each case that enables one, P2 over the -1 convention's."""
from __future__ import annotations

from harness.case import load_case
from harness.checks import check_case
from harness.props.p2 import check_padded_lanes
from harness.verdict import Verdict

PAD_MINUS_ONE_CASE, RAGGED_CASE, PIECEWISE_CASE = "tp2_dp2_pad_minus_one", "tp2_ragged_draft_extend", "tp2_piecewise"


def probe_case_pad_minus_one() -> dict[str, Verdict]:
    return check_case(load_case(PAD_MINUS_ONE_CASE)).verdicts


def probe_padded_lanes_pad_minus_one() -> dict[str, Verdict]:
    return check_padded_lanes(load_case(PAD_MINUS_ONE_CASE))


def probe_case_ragged() -> dict[str, Verdict]:
    return check_case(load_case(RAGGED_CASE)).verdicts


def probe_case_piecewise() -> dict[str, Verdict]:
    return check_case(load_case(PIECEWISE_CASE)).verdicts


SHAPE_PROBES = (("case-pad-minus-one", probe_case_pad_minus_one), ("padded-lanes-pad-minus-one", probe_padded_lanes_pad_minus_one),
                ("case-ragged", probe_case_ragged), ("case-piecewise", probe_case_piecewise))
