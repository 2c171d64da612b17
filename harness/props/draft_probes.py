"""Probes over the drafts of a kind or placement of their own, for `harness mutants` (registered by P6): the EAGLE3
draft (runners.llama_eagle3) and the draft at a TP size of its own (runners.draft_parallel), over their shipped cases.

The tree probes run the case's workload eagerly against its draft-tree golden (P6); the loop probes run it eager and
graph (harness.props.draft_decode.check_decode_case): P1 on every draft-decode replay, P3 eager vs graph trees, P6 the
acceptance golden and the draft-tree golden, whose probabilities see what only the draft's numbers show (a layer
captured off by one, a rotary base, a draft-to-target id). The same cases through one case run (P1, P3, P4) are the
case probes of harness.pipeline.mutants.
"""
from __future__ import annotations

from harness.cases.case import load_case
from harness.golden.draft_tree import check_tree_golden
from harness.props.base import Probe, Verdicts
from harness.props.draft_decode import check_decode_case
from harness.props.p6_acceptance import P6
from harness.run.loop import case_session
from harness.verdict import Verdict

EAGLE3_CASE = "tp2_dp2_eagle3"  # TP2 DP2, EAGLE3 with three captured layers, a 256-token vocab, topk 2 trees
DRAFT_TP_CASE = "tp4_dp2_eagle3_draft_tp1"  # TP4 DP2, the EAGLE3 draft at TP1 with its own rotary table, proposals handed on


def eager_tree(name: str) -> Verdicts:
    """P6 on the eager run alone: its draft trees against the case's draft-tree golden. The cheap probe for a mutant of
    the step body, which eager and graph share."""
    case, v = load_case(name), Verdict(P6)
    check_tree_golden(v, case, {"eager": case_session(case, "eager")})
    return {P6: v}


DRAFT_PROBES = (
    Probe.guarded("eagle3-tree", lambda: eager_tree(EAGLE3_CASE)),
    Probe.guarded("eagle3-loop", lambda: check_decode_case(load_case(EAGLE3_CASE))),
    Probe.guarded("draft-tp-tree", lambda: eager_tree(DRAFT_TP_CASE)),
    Probe.guarded("draft-tp-loop", lambda: check_decode_case(load_case(DRAFT_TP_CASE))),
)
