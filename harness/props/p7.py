"""P7 uneven DP load: idle DP ranks and busy ones agree on every collective, and nothing hangs.

An idle DP group (no requests this iteration) must still run the step: the scheduler's
MLP sync (an all_gather of batch sizes over the attn-DP group), then the padded dummy
path, the engine's IDLE forward. In the graph runner that is a replay of a captured
bucket with raw_bs = 0 (the MLP-TP branch: the same bucket every DP group replays); in
eager it is the step body with zero tokens, which still joins every collective. Skipping
one collective on an idle rank is the classic hang of DP attention.

`check_idle_ranks(sc, ranks)` runs a scenario's eager and graph draft-extend on simulated
or real ranks and checks, from the per-rank collective traces:

* run: every rank completes; a desync is a failure named by rank and collective (never a
  hang: simulated ranks detect it at once, real ones by signature exchange, deadlock
  detection or the parent's timeout);
* same-program: every rank issued the same sequence of (op, group) calls, idle or busy;
* group-agreement: on every group instance, the k-th call of every member has the same
  op, group, dtype and shape (all_gather_v: the trailing dims);
* idle-path: an idle rank replayed a captured graph for every step (raw_bs 0, a real
  bucket, no eager fallback; MLP-TP branch: the busy groups' bucket) and its eager path
  ran zero rows.

P7 drives the draft-extend runners (`run_rank`): the iterations of a schedule are decode
iterations, each a draft-extend over every DP group. The draft decode's and the verify's idle
groups run inside the loop, where the DP churn script (harness.props.p8) idles each group once.
The collective checks themselves are harness.props.collectives', which also checks every step of
a loop whose DP groups run mixed forward modes (reported with the loop's run; the
mixed-modes-case probe below runs that case for the mutant catalog).
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

from harness.cases.case import seeded_requests
from harness.mutants import get
from harness.props.base import Needs, Probe, Property
from harness.props.collectives import P7, check_collective_agreement
from harness.props.p5 import feature_case
from harness.ranks import RanksKind
from harness.ranks import run as ranks_run
from harness.ranks.simulated import RankFailure
from harness.ranks.trace import CollectiveCall, CollectiveError
from harness.run.crash import crash_detail, crash_name
from harness.run.rig import RankRun, run_rank
from harness.run.scenario import Scenario
from harness.verdict import Verdict
from runners.config import ModelConfig, SpecConfig
from runners.parallel.layout import Branch, ParallelLayout

# Small and fast: two draft steps, three buckets. (On a gathered layout the buckets are
# multiples of attn_tp_size, so tp4 dp2 captures 2 and 4.)
P7_SPEC = SpecConfig(num_steps=2, capture_bs=(1, 2, 4), max_running_requests=4)

MLP_TP4_DP2 = ParallelLayout(tp_size=4, dp_size=2, enable_dp_attention=True)
MLP_TP4_DP4 = ParallelLayout(tp_size=4, dp_size=4, enable_dp_attention=True)
MLP_TP2_DP2 = ParallelLayout(tp_size=2, dp_size=2, enable_dp_attention=True)
ATTN_TP4_DP2 = ParallelLayout(4, 2, True, moe_dense_tp_size=1, enable_dp_lm_head=True, moe_a2a_backend="deepep")
NEITHER_TP4_DP4 = ParallelLayout(4, 4, True, moe_dense_tp_size=1, enable_dp_lm_head=True, moe_a2a_backend="deepep")

# (layout, schedule): per iteration the raw bs of each DP group, 0 = idle. Each DP group
# is idle at least once, next to busy groups; the last rows make the idle groups' count
# of attn-DP collectives differ if an idle rank skips one (so a skip cannot cancel out).
P7_SCHEDULES: tuple[tuple[ParallelLayout, tuple[tuple[int, ...], ...]], ...] = (
    (MLP_TP4_DP2, ((3, 0), (0, 2), (1, 1))),
    (MLP_TP4_DP4, ((2, 0, 0, 1), (0, 3, 0, 0))),
    (MLP_TP2_DP2, ((2, 0), (0, 1), (1, 1))),
    (ATTN_TP4_DP2, ((2, 0), (1, 1))),
    (NEITHER_TP4_DP4, ((1, 0, 0, 2),)),
)


def idle_scenario(layout: ParallelLayout, schedule: Sequence[Sequence[int]], spec: SpecConfig = P7_SPEC,
                  model: Optional[ModelConfig] = None, seed: int = 0, max_prefix_len: int = 16) -> Scenario:
    sched = tuple(tuple(row) for row in schedule)
    its = seeded_requests(seed, sched, spec.num_tokens_per_bs, max_prefix_len)
    name = f"p7-{layout.describe().split(' ')[0]}-" + "_".join("".join(map(str, row)) for row in sched)
    return Scenario(model or ModelConfig(), spec, layout, its, seed=seed, name=name)


def p7_scenarios() -> list[Scenario]:
    return [idle_scenario(layout, sched) for layout, sched in P7_SCHEDULES]


# ---------------------------------------------------------------------------------------
# running with traces, on simulated or real ranks
# ---------------------------------------------------------------------------------------


def planted_run_rank(comm, mutant_id: Optional[str], sc: Scenario, runner: str = "both", single_layer: bool = False,
                     graph_kind: str = "auto", device: str = "cpu") -> RankRun:
    """run_rank with a catalog mutant planted in this rank's process (real ranks are fresh processes)."""
    ctx = contextlib.nullcontext()
    if mutant_id:

        ctx = get(mutant_id).planted()
    with ctx:
        return run_rank(comm, sc, runner=runner, single_layer=single_layer, graph_kind=graph_kind, device=device)


def run_with_traces(sc: Scenario, ranks: RanksKind | str = RanksKind.SIM, timeout_s: float = 60.0, runner: str = "both",
                    mutant: Optional[str] = None, **launch_kw) -> tuple[list[RankRun], list[list[CollectiveCall]]]:
    """(per-rank RankRun, per-rank collective trace). Raises RankFailure (sim) or a CollectiveError (real).

    Simulated ranks share this process: the mutant is planted once around them; real ranks plant it each."""
    kind = RanksKind.parse(ranks)
    ctx = get(mutant).planted() if mutant and kind is RanksKind.SIM else contextlib.nullcontext()
    with ctx:
        return ranks_run(sc.layout, planted_run_rank, None if kind is RanksKind.SIM else mutant, sc, runner, False, "auto", kind.device,
                         ranks=kind, timeout_s=timeout_s, **launch_kw)


# ---------------------------------------------------------------------------------------
# the checks
# ---------------------------------------------------------------------------------------


def check_idle_path(sc: Scenario, runs: Sequence[RankRun], v: Optional[Verdict] = None) -> Verdict:
    """Idle ranks ran the padded dummy path: a graph replay of a real bucket (eager: zero rows)."""
    v = v or Verdict(P7)
    layout = sc.layout
    for run in runs:
        d = layout.attn_dp_rank(run.rank)
        if run.stats is not None:
            v.expect_equal("idle-path", "eager fallbacks", {"layout": layout.describe(), "rank": run.rank}, 0, run.stats.eager_fallbacks,
                           "every rank, idle or busy, replays a captured graph")
        for it, iteration in enumerate(sc.iterations):
            sizes = iteration.dp_batch_sizes
            if sizes[d] != 0:
                continue
            w = {"layout": layout.describe(), "rank": run.rank, "iteration": it, "dp_batch_sizes": sizes}
            if it < len(run.eager):
                for step, res in enumerate(run.eager[it]):
                    v.expect_equal("idle-path", "eager logits rows", {**w, "step": step}, 0, int(res.out.logits.shape[0]))
            if run.stats is None:
                continue
            recs = run.records[it] if it < len(run.records) else []
            if not v.expect_equal("idle-path", "graph replays", w, sc.spec.num_steps, len(recs), "an idle rank replays every step's graph"):
                continue
            for rec in recs:
                ws = {**w, "step": rec.step}
                v.expect_equal("idle-path", "raw_bs", ws, 0, rec.raw_bs)
                v.expect_equal("idle-path", "bucket captured", ws, True, rec.bs in rec.captured_bs and rec.bs >= 1, f"bucket {rec.bs}")
                if layout.branch is Branch.MLP_TP_GATHER:
                    busy = [r for r in runs if sizes[layout.attn_dp_rank(r.rank)] > 0 and it < len(r.records) and r.records[it]]
                    if busy:
                        want = busy[0].records[it][rec.step].bs
                        v.expect_equal("idle-path", "bucket", ws, want, rec.bs,
                                       f"the bucket busy rank {busy[0].rank} replayed (every DP group replays one bucket)")
    return v


def _where(sc: Scenario, ranks: str) -> dict:
    return {"layout": sc.layout.describe(), "ranks": ranks, "scenario": sc.name}


def run_verdict(sc: Scenario, err: BaseException, ranks: str) -> Verdict:
    v = Verdict(P7, checked=1)
    v.fail("run", "collectives", _where(sc, ranks), "every rank issues the same collectives and completes", crash_name(err), crash_detail(err))
    return v


def check_idle_ranks(sc: Scenario, ranks: str = "sim", timeout_s: float = 60.0, mutant: Optional[str] = None) -> Verdict:
    """P7 on one scenario: run it (eager and graph) and check agreement and the idle path."""
    try:
        runs, traces = run_with_traces(sc, ranks, timeout_s, mutant=mutant)
    except (RankFailure, CollectiveError) as err:
        return run_verdict(sc, err, ranks)
    v = Verdict(P7)
    if not any(0 in it.dp_batch_sizes for it in sc.iterations):
        v.notes.append(f"{sc.name}: no idle DP group in this schedule")
    check_collective_agreement(sc.layout, traces, v)
    check_idle_path(sc, runs, v)
    return v


def probe_idle_ranks() -> dict[str, Verdict]:
    """The `harness mutants` probe: P7 over the built-in idle schedules on simulated ranks (~2-3 s)."""
    v = Verdict(P7)
    for sc in p7_scenarios():
        v.merge(check_idle_ranks(sc, "sim", timeout_s=30.0))
    return {P7: v}


MIXED_MODES_CASE = "tp3_dp3_mixed_modes"  # DP groups extending, verifying and idle in one step (runners.mixed_modes)

PROPERTY = Property(
    P7, "uneven DP load", Needs.SCHEDULES,
    runs_under="pytest and `harness mutants`",
    probes=(
        Probe("p7-idle-ranks", probe_idle_ranks),
        # mixed DP modes through the loop: every step's collectives (P7; the acceptance golden, P6), a few seconds
        Probe.guarded("mixed-modes-case", lambda: feature_case(MIXED_MODES_CASE)),
    ),
)
