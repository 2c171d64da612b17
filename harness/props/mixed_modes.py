"""P7 over the loop of a case with mixed DP modes (runners.mixed_modes): in every step, whatever mode each DP group
ran (EXTEND, TARGET_VERIFY, IDLE), every rank issued the same collectives with the same shapes; and the case's workload
did mix the modes, so the check saw what it is for.

The simulated ranks already fail a step whose collectives disagree (a CollectiveMismatch, a "run" failure naming the
rank and the call); this reads the traces of the steps that completed, so a disagreement the rendezvous cannot see (two
groups that each agree within themselves but differ between each other) is caught too.
"""
from __future__ import annotations

from harness.p7 import check_collective_agreement
from harness.spec_decode import SpecSession
from harness.verdict import Verdict

MIXED = {"EXTEND", "TARGET_VERIFY", "IDLE"}


def check_mixed_modes(session: SpecSession, where: dict) -> Verdict:
    v = Verdict("P7")
    if not session.keep_traces:
        v.fail("mixed modes", "traces", where, "a session that keeps its collective traces", "none kept")
        return v
    for step, traces in enumerate(session.traces):
        sv = check_collective_agreement(session.layout, traces)
        for f in sv.failures:
            f.where.update({**where, "step": step, "dp_forward_modes": session.reports[step][0].dp_forward_modes})
        v.merge(sv)
    modes = [reps[0].dp_forward_modes for reps in session.reports]
    v.checked += 1
    if not any(MIXED <= set(m) for m in modes):
        v.fail("mixed modes", "dp_forward_modes", where, "a step whose DP groups extend, verify and idle at once", modes,
               "the workload never mixed the three modes: the schedule does not exercise the feature")
    return v
