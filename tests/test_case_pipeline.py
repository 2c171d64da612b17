"""One case pipeline: `harness check` and `harness replay` build a case's runs once and judge them alike, by the case's
own tolerances; the failures a person reads name both sides of a symmetric invariant, the values that differ, and the
property that names a padded lane."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness import mutants
from harness.cases.case import load_case
from harness.pipeline.check import check_case
from harness.pipeline.replay import format_table, replay_case
from harness.props.outputs import compare_outputs
from harness.props.p1_metadata import check_metadata
from harness.props.p3 import check_loop_replayed
from harness.props.tolerances import Tol
from harness.run import case_run
from harness.run.loop import SpecSession
from harness.verdict import Verdict
from runners.config import SpecConfig
from runners.parallel.layout import ParallelLayout

OVERRIDE_CASE = "tp2_attn_tp_gather_explicit"  # ships cross_layout = atol 2e-5, rtol 0 (the default: 1e-4 + 1e-4 relative)


@pytest.fixture
def drift_off_tp1(monkeypatch):
    """Every rank run of a layout other than TP1 drifts by 5e-5 on its logits, eager and graph alike: P3 can't see it,
    P4 (against the TP1 oracle, which does not drift) sees it under the case's bound and not under the default."""
    real = case_run.run_rank

    def drifting(comm, sc, *args, **kwargs):
        run = real(comm, sc, *args, **kwargs)
        if sc.layout.world_size > 1:
            for steps in run.eager + run.graph:
                for res in steps:
                    res.out.logits.add_(5e-5)
        return run

    monkeypatch.setattr(case_run, "run_rank", drifting)


def test_the_shipped_override_is_tighter_than_the_default():
    tol = load_case(OVERRIDE_CASE).tol("cross_layout")
    assert (tol.rtol, tol.atol) == (0.0, 2e-5)


def test_check_and_replay_judge_a_case_by_its_own_tolerances(drift_off_tp1):
    case = load_case(OVERRIDE_CASE)
    checked, replayed = check_case(case), replay_case(case).report
    for rep in (checked, replayed):
        assert rep.verdicts["P3"].ok and not rep.verdicts["P4"].ok
        assert "atol=2e-05" in rep.verdicts["P4"].failures[0].detail
    assert [f.where for f in checked.verdicts["P4"].failures] == [f.where for f in replayed.verdicts["P4"].failures]
    default = replace(case, tolerances={})  # the same drift under harness/props/tolerances.py's bound passes
    assert check_case(default).verdicts["P4"].ok and replay_case(default).report.verdicts["P4"].ok


def test_a_case_run_and_its_oracle_are_built_once_for_every_property(monkeypatch):
    calls = []
    real = case_run.run_spmd
    monkeypatch.setattr(case_run, "run_spmd", lambda sc, **kw: calls.append(sc.name) or real(sc, **kw))
    rep = check_case(load_case("tp1_neither"), props=("P1", "P3", "P4"))
    assert rep.ok and calls == ["tp1_neither", "tp1_neither@tp1"]


def test_progress_says_which_property_and_layout():
    said: list[str] = []
    check_case(load_case("tp1_neither"), on_progress=said.append)
    assert any(m.startswith("P3 eager vs graph: tp1") for m in said) and any("iteration 3/3 done" in m for m in said)


def test_symmetric_invariants_blame_the_side_that_breaks_the_rule():
    """sglang-26416 counts requests in the attn-TP branch: on the MLP-TP layout, I3 blames its attn-TP sibling."""
    case = load_case("tp4_dp2_mlp_tp_gather")
    with mutants.get("sglang-26416").planted():
        v = check_metadata(case.layout, case.scenario.spec, case.schedule, case.scenario.model, case.scenario.seed)
    (f,) = [f for f in v.failures if f.check == "I3"][:1]
    assert f.expected == [4, 4] and f.got == [1, 1]  # the rule (T = 4 rows per request) and the wrong side's values
    assert "mlp_tp_gather branch (this layout) [4, 4]" in f.detail and "attn_tp_gather sibling" in f.detail
    assert "the attn_tp_gather sibling" in f.detail.split(";")[-1] and "harness explain I3" in f.detail


def test_i2_blames_the_rows_fed_not_the_refilled_count():
    """At step 1 the replay fill rewrote for_logprob to bs * T; the graph, baked with [bs], fed lm_head bs rows."""
    with mutants.get("sglang-26416").planted():
        rep = check_case(load_case("tp4_attn_tp_gather"), props=("P1",))
    i2 = [f for f in rep.verdicts["P1"].failures if f.check == "I2" and f.where.get("step") == 1]
    assert i2 and {f.field for f in i2} == {"rows fed to lm_head"}
    f = i2[0]
    assert (f.expected, f.got) == (f.where["bs"] * 4, f.where["bs"]) and f"global_num_tokens_for_logprob {f.where['bs'] * 4}" in f.detail


def test_expect_agree_names_both_sides():
    v = Verdict("PX")
    assert v.expect_agree("I9", None, {}, {"left": 4, "right": 4}, 4, "four")
    assert not v.expect_agree("I9", None, {}, {"left": 4, "right": 1}, 4, "four")
    assert not v.expect_agree("I9", "f", {}, {"left": 2, "right": 1}, 4, "four")
    (one, both) = v.failures
    assert (one.field, one.expected, one.got) == ("right", 4, 1) and "left 4, right 1" in one.detail
    assert (both.field, both.got) == ("f", {"left": 2, "right": 1}) and "the left and right break it" in both.detail
    assert v.checked == 3


def test_float_differences_show_the_values_at_the_first_columns():
    v = Verdict("PX")
    ref = {"logits": torch.tensor([[1.0, 2.0, 3.0, 4.0]]), "hidden": torch.zeros(1, 2), "logprobs": torch.zeros(1, 2),
           "topk_p": torch.zeros(1, 1), "topk_index": torch.zeros(1, 1, dtype=torch.int64)}
    got = {**ref, "logits": torch.tensor([[1.0, 2.5, 3.0, float("nan")]])}
    compare_outputs(v, "cmp", {}, ref, got, Tol(1e-5, 1e-5, "test"))
    (f,) = v.failures
    assert (f.expected, f.got) == ([2.0, 4.0], [2.5, "nan"]) and "column(s) [1, 3]" in f.detail


def test_a_graph_only_difference_on_a_padded_bucket_points_at_p2():
    """draft-extend-hidden-not-copied: the graph reads the last batch's hidden states; tp1_neither pads 3 -> 4, 5 -> 8."""
    with mutants.get("draft-extend-hidden-not-copied").planted():
        rep = check_case(load_case("tp1_neither"))
    hinted = [f for f in rep.verdicts["P3"].failures if "harness check tp1_neither --props P2" in f.detail]
    assert hinted and all(f.where["bs"] > f.where["raw_bs"] for f in hinted)


def test_the_replay_table_folds_identical_ranks_and_marks_diverging_rows():
    with mutants.get("sglang-26416").planted():
        rep = replay_case(load_case("tp4_attn_tp_gather"), step=1)
    rows = [ln for ln in format_table(rep).splitlines() if ln.strip()[:1].isdigit()]
    assert len(rows) == 3 and all(ln.split()[2] == "0-3" and ln.endswith("<< diverges") for ln in rows)  # 3 iterations, 4 ranks each
    assert all(r.diverges for r in rep.rows) and len(rep.rows) == 12


def test_loop_replayed_fails_by_name_for_a_runner_the_engine_never_built():
    spec = SpecConfig(num_steps=2, capture_bs=(1, 2, 4), max_running_requests=4)
    v = Verdict("P3")
    check_loop_replayed(v, SpecSession(ParallelLayout(), spec, runner="eager"), {"case": "eager"})
    assert [f.field for f in v.failures] == ["graph replays > 0", "target verify replays > 0"]
    assert all("no such graph runner on rank(s) [0]" in f.got for f in v.failures) and v.checked == 2
    v = Verdict("P3")
    check_loop_replayed(v, SpecSession(ParallelLayout(), spec, runner="graph", proposer="target"), {"case": "target"})
    assert v.failures[0].field == "graph replays > 0" and "no such graph runner" in v.failures[0].got  # the target drafts: no driver
