"""P7 uneven DP load on simulated ranks: the property, its trace checks, and its mutant."""
from __future__ import annotations

import dataclasses
import time
import unittest.mock as mock

from harness.mutants import get
from harness.pipeline.mutants import _is_timeout, probes
from harness.props.p7 import (
    ATTN_TP4_DP2,
    MLP_TP4_DP2,
    P7_SCHEDULES,
    check_collective_agreement,
    check_idle_path,
    check_idle_ranks,
    idle_scenario,
    probe_idle_ranks,
    run_with_traces,
)
from harness.ranks.trace import CollectiveCall
from runners.draft_extend import run_eager
from runners.draft_extend_graph_driver import DraftExtendGraphDriver

MUTANT = "idle-rank-skips-mlp-sync"


def test_probe_passes_fast_and_is_registered():
    assert any(p.id == "p7-idle-ranks" and p.run is probe_idle_ranks for p in probes())
    t0 = time.perf_counter()
    v = probe_idle_ranks()["P7"]
    assert v.ok, v.report()
    assert v.checked > 500
    assert time.perf_counter() - t0 < 15  # ~1.3 s alone on 2 cores; headroom for a loaded -n run
    # every schedule has an idle group next to a busy one
    assert all(any(0 in row and sum(row) > 0 for row in sched) for _, sched in P7_SCHEDULES)


def test_mutant_is_killed_by_p7_as_a_mismatch_not_a_timeout():
    with get(MUTANT).planted():
        v = probe_idle_ranks()["P7"]
    assert not v.ok and not _is_timeout(v)
    assert {f.got for f in v.failures if f.check == "run"} == {"CollectiveMismatch"}
    first = v.failures[0]
    assert "all_gather(group=attn_dp, shape=(1,), dtype=int64)" in first.detail  # the sync the idle rank skipped
    assert "shape=(0, 64), dtype=float32" in first.detail  # what the idle rank called instead
    assert "rank " in first.detail


def test_a_symmetric_skip_that_never_hangs_is_still_caught_by_the_trace_check():
    # attn-TP gather: the MLP sync is the only attn-DP collective. Each group idle once: the
    # skips pair up, the run completes (with wrong batch sizes), and only same-program sees it.
    sc = idle_scenario(ATTN_TP4_DP2, ((2, 0), (0, 1)))
    runs, traces = run_with_traces(sc, "sim", mutant=MUTANT)
    assert len(runs) == 4
    v = check_idle_ranks(sc, mutant=MUTANT)
    assert [f.check for f in v.failures] == ["same-program"]
    assert "all_gather(group=attn_dp, shape=(1,), dtype=int64)" in v.failures[0].expected


def _call(seq, op="all_gather", group="attn_dp", ranks=(0, 1), shape=(4, 8), dtype="torch.float32"):
    return CollectiveCall(seq, op, group, ranks, shape, dtype)


def test_collective_agreement_on_synthetic_traces():
    from runners.parallel.layout import ParallelLayout

    layout = ParallelLayout(tp_size=2, dp_size=2, enable_dp_attention=True)
    ok = [[_call(0), _call(1, "all_gather_v", shape=(3, 8))], [_call(0), _call(1, "all_gather_v", shape=(5, 8))]]
    assert check_collective_agreement(layout, ok).ok  # all_gather_v: dim 0 may differ
    bad_shape = [[_call(0)], [_call(0, shape=(2, 8))]]
    v = check_collective_agreement(layout, bad_shape)
    assert [f.check for f in v.failures] == ["group-agreement"]
    assert v.failures[0].detail == ("rank 1 called all_gather(group=attn_dp, shape=(2, 8), dtype=float32) [its collective #0] "
                                    "where rank 0 called all_gather(group=attn_dp, shape=(4, 8), dtype=float32) [its collective #0]")
    short = [[_call(0), _call(1, dtype="torch.int64")], [_call(0)]]
    v = check_collective_agreement(layout, short)
    assert {f.check for f in v.failures} == {"same-program", "group-agreement"}
    assert "nothing" in v.failures[-1].got


def test_idle_path_checks_the_padded_dummy_path():
    sc = idle_scenario(MLP_TP4_DP2, ((3, 0), (1, 1)))
    runs, _ = run_with_traces(sc, "sim")
    assert check_idle_path(sc, runs).ok
    rec = runs[2].records[0][0]
    assert (rec.raw_bs, rec.bs) == (0, runs[0].records[0][0].bs) == (0, 4)  # idle rank 2 replays the busy group's bucket
    assert runs[2].eager[0][0].out.logits.shape[0] == 0  # eager: zero rows, every collective joined
    runs[2].stats.eager_fallbacks = 1
    runs[3].records[0] = runs[3].records[0][:1]
    runs[2].records[0][0] = dataclasses.replace(rec, bs=2)
    v = check_idle_path(sc, runs)
    assert {(f.field, f.where["rank"]) for f in v.failures} == {("eager fallbacks", 2), ("graph replays", 3), ("bucket", 2)}


def test_an_idle_rank_running_eager_instead_of_the_graph_desyncs_the_logits_gather():
    sc = idle_scenario(MLP_TP4_DP2, ((2, 0), (1, 1)))
    real_run = DraftExtendGraphDriver.run

    def idle_falls_back(self, inp):  # the idle ranks skip the padded graph and run eager instead
        if inp.bs == 0:
            self.backend.stats.eager_fallbacks += 1
            return run_eager(self.worker, inp)[0]  # the driver returns the steps' outputs
        return real_run(self, inp)

    with mock.patch.object(DraftExtendGraphDriver, "run", idle_falls_back):
        v = check_idle_ranks(sc)
    f = v.failures[0]
    assert (f.check, f.got) == ("run", "CollectiveMismatch")
    assert "all_reduce(group=world, shape=(12, 64)" in f.detail and "shape=(6, 64)" in f.detail
