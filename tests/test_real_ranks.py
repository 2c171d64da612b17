"""Properties on real ranks (gloo on CPU, a process per rank), and simulated vs real.

One launch per layout checks everything at once (spawning ranks costs a few seconds
each): P1 (run metadata), P3 eager vs graph, P4 against TP1, P7 idle DP ranks, and the
simulated ranks' results and collective traces, which must be bitwise identical on gloo.
Planted idle-rank skips must come back as a mismatch or a deadlock naming the rank and
the collective, well inside 60 s, and leave no process behind.
"""
from __future__ import annotations

import json
import multiprocessing
import time

import pytest
import torch

from harness import cli
from harness.cases.case import load_case
from harness.pipeline.check import check_case
from harness.pipeline.mutants import _is_timeout
from harness.props.p1 import check_run_metadata
from harness.props.p3 import check_eager_vs_graph
from harness.props.p4 import check_cross_layout
from harness.props.p7 import (
    MLP_TP2_DP2,
    check_collective_agreement,
    check_idle_path,
    check_idle_ranks,
    idle_scenario,
    run_verdict,
    run_with_traces,
)
from harness.props.sim_vs_real import compare_run_traces, compare_runs, real_tolerance
from harness.ranks import launcher
from harness.ranks.launcher import (
    DistributedDeadlock,
    DistributedMismatch,
    DistributedRankFailure,
    DistributedTimeout,
)
from harness.run.case_run import run_spmd
from harness.run.crash import crash_name
from harness.verdict import Verdict
from runners.parallel.layout import ParallelLayout
from tests.helpers.process_tree import live_children

pytestmark = pytest.mark.distributed

MUTANT = "idle-rank-skips-mlp-sync"
# tp2 dp2 with dp == tp and the attn-TP flags: branch "neither"; the only attn-DP collective is the MLP sync
NEITHER_TP2_DP2 = ParallelLayout(2, 2, True, moe_dense_tp_size=1, enable_dp_lm_head=True, moe_a2a_backend="deepep")


@pytest.fixture(autouse=True)
def no_leftover_processes():
    before = {pid for pid, _, _ in live_children()}
    yield
    assert multiprocessing.active_children() == []
    assert [c for c in live_children() if c[0] not in before] == []


def _properties(sc, runs, traces, ranks: str) -> dict[str, Verdict]:
    """Every property we can judge from one real-rank run, plus equality with the simulated ranks."""
    oracle = run_spmd(sc.as_tp1(), runner="eager")
    sim_runs, sim_traces = run_with_traces(sc, "sim")
    out = {
        "P1": check_run_metadata(sc, runs),
        "P3": check_eager_vs_graph(sc, runs),
        "P4": check_cross_layout(sc, runs, oracle, "eager").merge(check_cross_layout(sc, runs, oracle, "graph")),
        "P7": check_idle_path(sc, runs, check_collective_agreement(sc.layout, traces)),
        "sim-vs-real": compare_run_traces(sim_traces, traces, compare_runs(sim_runs, runs, real_tolerance(ranks, sc.model.dtype))),
    }
    return out


def test_properties_on_gloo_equal_simulated():
    """World size 4, the shipped idle-rank case (MLP-TP gather, each DP group idle in turn):
    attn-TP and attn-DP groups of two members each. A world-size-2 twin of it (tp2-dp2, the
    same branch, singleton attn-TP groups) added nothing this one and the singleton groups of
    test_every_collective_on_gloo[tp2] do not cover, at half this test's time."""
    name = "ws4-tp4-dp2-mlp-idle"
    sc = load_case("tp4_dp2_mlp_idle_rank").scenario
    assert any(0 in it.dp_batch_sizes for it in sc.iterations)
    t0 = time.monotonic()
    runs, traces = run_with_traces(sc, "gloo", timeout_s=120)
    launched = time.monotonic() - t0
    verdicts = _properties(sc, runs, traces, "gloo")
    report = "\n".join(v.report() for v in verdicts.values())
    assert all(v.ok for v in verdicts.values()), report
    assert all(v.checked > 0 for v in verdicts.values()), report
    # idle ranks replayed graphs like busy ones: every rank the same number of replays, no fallback
    assert len({r.stats.replays for r in runs}) == 1 and all(r.stats.eager_fallbacks == 0 for r in runs)
    print(f"{name}: launch {launched:.1f} s; " + "; ".join(f"{k} {v.checked} checks" for k, v in verdicts.items()))


def _replay_verdicts(capsys) -> tuple[set[tuple[int, str]], bool]:
    """(rank, field) of every P1 failure, and whether P4 held."""
    out = json.loads(capsys.readouterr().out)
    return {(f["where"]["rank"], f["field"]) for f in out["properties"]["P1"]["failures"]}, out["properties"]["P4"]["ok"]


def test_replay_on_spawned_gloo_ranks_plants_the_mutant_in_every_rank(capsys, monkeypatch):
    """The issue: `replay --ranks gloo --mutant ID` was refused. P1 judges each rank's own replay records and P4 each
    rank's outputs, so the seed bug's field on rank 1 and a P4 failure can only come from rank processes that ran it."""
    args = ["replay", "tp2_attn_tp_gather_explicit", "--ranks", "gloo", "--mutant", "sglang-26416", "--runner", "graph", "--json"]
    assert cli.main(args) == 1
    p1, p4_ok = _replay_verdicts(capsys)
    assert (1, "rows fed to lm_head") in p1 and not p4_ok  # I2 blames the rows fed (its for_logprob agrees with them)
    monkeypatch.setattr(launcher, "planted_ids", lambda: ())  # the control: the ranks not told, they run the code as written
    cli.main(args)
    p1, p4_ok = _replay_verdicts(capsys)
    assert not any(rank == 1 for rank, _ in p1) and p4_ok


def test_cli_replay_and_check_on_gloo(capsys):
    assert cli.main(["replay", "tp2_neither", "--ranks", "gloo", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["first_divergence"] is None
    assert {k: v["ok"] for k, v in out["properties"].items()} == {"P1": True, "P3": True, "P4": True}
    assert {row["rank"] for row in out["steps"]} == {0, 1}
    assert all(row["bs"] is not None and row["max_logit_diff"] <= 1e-5 for row in out["steps"])
    args = cli.build_parser().parse_args(["check", "tp2_neither", "--ranks", "gloo"])
    assert args.ranks == "gloo"
    if not torch.cuda.is_available():
        assert cli.main(["check", "tp2_neither", "--ranks", "nccl"]) == 2
        assert "nccl needs 2 GPUs" in capsys.readouterr().err


def test_planted_idle_skip_is_a_mismatch_named_by_rank_and_collective():
    """P7 with the mutant planted in every rank process: a signature mismatch, not a hang."""
    sc = idle_scenario(MLP_TP2_DP2, ((2, 0), (0, 1), (1, 1)))
    t0 = time.monotonic()
    v = check_idle_ranks(sc, "gloo", timeout_s=45, mutant=MUTANT)
    elapsed = time.monotonic() - t0
    assert elapsed < 60, elapsed
    assert not v.ok and len(v.failures) == 1
    f = v.failures[0]
    assert (f.check, f.got) == ("run", "CollectiveMismatch")
    assert not _is_timeout(v)  # a kill, not a timeout
    assert f.detail.startswith("collective mismatch in group attn_dp (ranks (0, 1)): rank 1 called "
                               "all_gather(group=attn_dp, shape=(0, 64), dtype=float32)"), f.detail
    assert "where rank 0 called all_gather(group=attn_dp, shape=(1,), dtype=int64)" in f.detail
    # the simulated ranks see the same desync (the arrival order decides which side is named first)
    sim = check_idle_ranks(sc, "sim", mutant=MUTANT).failures[0]
    assert sim.got == "CollectiveMismatch"
    assert "all_gather(group=attn_dp, shape=(0, 64), dtype=float32)" in sim.detail and "shape=(1,), dtype=int64" in sim.detail


def test_planted_hang_is_a_deadlock_naming_the_stuck_rank_and_collective():
    """An idle rank skips the MLP sync where the sync is the only attn-DP collective: its peer
    waits for ever in the next one. No signature exchange (as on NCCL): the parent sees a rank
    waiting for one that has returned, and says which collective it is stuck in."""
    sc = idle_scenario(NEITHER_TP2_DP2, ((1, 0), (1, 1)))
    t0 = time.monotonic()
    with pytest.raises(DistributedDeadlock) as ei:
        run_with_traces(sc, "gloo", timeout_s=45, mutant=MUTANT, check_signatures=False)
    elapsed = time.monotonic() - t0
    assert elapsed < 60, elapsed
    e = ei.value
    assert e.states[1] == "finished"
    assert e.states[0].startswith("stuck in all_gather(group=attn_dp, shape=(1,), dtype=int64) [collective #"), e.states
    assert "rank 0 waits in a collective for rank 1, which returned from fn" in str(e)
    v = run_verdict(sc, e, "gloo")
    assert v.failures[0].got == "CollectiveMismatch" and not _is_timeout(v)
    assert "rank 0: stuck in all_gather(group=attn_dp, shape=(1,), dtype=int64)" in v.failures[0].detail
    # simulated: the same skip, reported as the rank that returned without calling it
    sim = check_idle_ranks(sc, "sim", mutant=MUTANT).failures[0]
    assert sim.got == "CollectiveMismatch"
    assert "rank 1 returned from fn without calling all_gather(group=attn_dp, shape=(1,), dtype=int64)" in sim.detail


def test_real_rank_errors_become_run_verdicts(monkeypatch):
    """check_case turns real-rank failures into a `run` verdict; timeouts stay timeouts (never kills)."""
    assert crash_name(DistributedTimeout("t", {0: "stuck"})) == "CollectiveTimeout"
    assert crash_name(DistributedDeadlock("d", {0: "stuck", 1: "finished"})) == "CollectiveMismatch"
    assert crash_name(DistributedMismatch("m", {0: "tb"})) == "CollectiveMismatch"
    tb = "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nValueError: planted"
    assert crash_name(DistributedRankFailure("f", {1: tb, 2: "exited without reporting: exit code 1"})) == "ValueError"
    assert crash_name(DistributedRankFailure("f", {0: "exited without reporting: killed by SIGKILL"})) == "DistributedRankFailure"
    import harness.run.case_run as case_run

    def timeout(*a, **k):
        raise DistributedTimeout("timed out: not every rank finished\nmore", {0: "stuck in all_reduce(...)", 1: "finished"})

    monkeypatch.setattr(case_run, "run_spmd", timeout)
    rep = check_case(load_case("tp2_neither"), ranks="gloo")
    v = rep.verdicts["run"]
    assert not rep.ok and v.failures[0].got == "CollectiveTimeout" and _is_timeout(v)
    assert v.failures[0].detail == "timed out: not every rank finished | rank 0: stuck in all_reduce(...)"


@pytest.mark.multigpu(1)  # conftest: skipped where this xdist worker's GPU slice is empty
@pytest.mark.gpu
def test_nccl_world_size_1():
    """NCCL where one GPU allows it: tp1 cases through check_case and against the simulated ranks."""
    for name in ("tp1_neither",):
        rep = check_case(load_case(name), ranks="nccl")
        assert rep.ok, "\n".join(v.report() for v in rep.verdicts.values())
    sc = load_case("tp1_neither").scenario
    runs, traces = run_with_traces(sc, "nccl", timeout_s=300)
    sim_runs, sim_traces = run_with_traces(sc, "sim")
    v = compare_run_traces(sim_traces, traces, compare_runs(sim_runs, runs, real_tolerance("nccl", sc.model.dtype)))
    assert v.ok, v.report()
    assert all(r.stats.replays > 0 and r.stats.eager_fallbacks == 0 for r in runs)
