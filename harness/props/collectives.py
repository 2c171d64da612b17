"""P7's checks over collective traces: every rank issued the same collectives, idle or busy (`check_collective_agreement`,
over the per-rank traces of a run), and, in a loop whose DP groups run mixed forward modes in one step
(runners.mixed_modes), in every step whatever mode each DP group ran (`check_mixed_modes`: EXTEND, TARGET_VERIFY,
IDLE), with the check that the workload did mix the modes, so it saw what it is for.

The simulated ranks already fail a step whose collectives disagree (a CollectiveMismatch, a "run" failure naming the
rank and the call); the traces of the steps that completed show a disagreement the rendezvous cannot see too (two
groups that each agree within themselves but differ between each other).
"""
from __future__ import annotations

from typing import Optional, Sequence

from harness.ranks.trace import CollectiveCall
from harness.run.loop import SpecSession
from harness.verdict import Verdict
from runners.parallel.layout import ParallelLayout

P7 = "P7"  # the property these checks report under (registered by harness.props.p7)


def _key(c: CollectiveCall) -> tuple:
    """What every member of a group instance must agree on (all_gather_v: members may hold different row counts)."""
    shape = (-1,) + tuple(c.shape[1:]) if c.op == "all_gather_v" and c.shape else tuple(c.shape)
    return (c.op, c.group, shape, c.dtype)


def _describe(c: Optional[CollectiveCall]) -> str:
    return "nothing (its trace on this group ends here)" if c is None else f"{c.describe()} [its collective #{c.seq}]"


def check_collective_agreement(layout: ParallelLayout, traces: Sequence[Sequence[CollectiveCall]], v: Optional[Verdict] = None) -> Verdict:
    """same-program and group-agreement over per-rank traces (simulated or real)."""
    v = v or Verdict(P7)
    where = {"layout": layout.describe()}
    # same-program: idle and busy ranks issue the same (op, group) sequence
    prog0 = [(c.op, c.group) for c in traces[0]]
    for r, t in enumerate(traces[1:], 1):
        v.checked += 1
        prog = [(c.op, c.group) for c in t]
        if prog != prog0:
            i = next((i for i, (a, b) in enumerate(zip(prog0, prog, strict=False)) if a != b), min(len(prog0), len(prog)))
            c0 = traces[0][i] if i < len(traces[0]) else None
            cr = t[i] if i < len(t) else None
            v.fail("same-program", f"collective #{i}", {**where, "rank": r}, f"rank 0: {_describe(c0)}", f"rank {r}: {_describe(cr)}",
                   f"rank {r} issued {len(prog)} collectives, rank 0 {len(prog0)}")
            break
    # group-agreement: the k-th call on each group instance matches across members
    per_instance: dict[tuple[int, ...], dict[int, list[CollectiveCall]]] = {}
    for r, t in enumerate(traces):
        for c in t:
            per_instance.setdefault(tuple(c.group_ranks), {}).setdefault(r, []).append(c)
    for inst, by_rank in sorted(per_instance.items()):
        members = [m for m in inst]
        calls = {m: by_rank.get(m, []) for m in members}
        ref_rank = members[0]
        ref = calls[ref_rank]
        longest = max(len(x) for x in calls.values())
        for k in range(longest):
            v.checked += 1
            a = ref[k] if k < len(ref) else None
            bad = next((m for m in members[1:] if (calls[m][k] if k < len(calls[m]) else None) is None or a is None
                        or _key(calls[m][k]) != _key(a)), None)
            if bad is not None:
                b = calls[bad][k] if k < len(calls[bad]) else None
                v.fail("group-agreement", f"collective #{k} of group instance ranks {inst}", {**where, "rank": bad},
                       f"rank {ref_rank}: {_describe(a)}", f"rank {bad}: {_describe(b)}",
                       f"rank {bad} called {_describe(b)} where rank {ref_rank} called {_describe(a)}")
                break
    return v


MIXED = {"EXTEND", "TARGET_VERIFY", "IDLE"}  # the forward modes a step of the mixed-modes case must run at once


def check_mixed_modes(session: SpecSession, where: dict) -> Verdict:
    """Every step of a session that kept its collective traces (SpecSession.keep_traces): the ranks agreed on every
    collective; and some step mixed all three modes."""
    v = Verdict(P7)
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
