"""Writing case files from outside the loader: `harness new-case` on the command line, and a failing
hypothesis example (or scenario) written as a case that `harness replay` reruns (issue 7)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cases.case import load_case
from harness.cases.template import write_failure_case
from harness.cli import main
from harness.pipeline.replay import replay_case
from harness.run.scenario import Iteration, RequestSpec, Scenario
from harness.run.strategies import failure_case, layouts, schedules, specs
from runners.config import ModelConfig, SpecConfig
from runners.parallel.layout import ParallelLayout


def test_new_case_cli_then_record_then_check(tmp_path, capsys):
    cases, goldens = tmp_path / "cases", tmp_path / "golden"
    rc = main(["new-case", "tp2_dp2_new", "--tp", "2", "--dp", "2", "--batches", "3,1 1,0", "--steps", "1", "--capture-bs", "2,4",
               "--dir", str(cases), "--golden-dir", str(goldens), "--record"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "tp2-dp2 [mlp_tp_gather]" in out and "new golden" in out and "schedule [[3, 1], [1, 0]]" in out
    assert main(["golden", "check", str(cases / "tp2_dp2_new.toml"), "--golden-dir", str(goldens)]) == 0
    assert "PASS" in capsys.readouterr().out


def test_new_case_cli_bad_layout_is_one_line(tmp_path, capsys):
    assert main(["new-case", "bad", "--tp", "4", "--dp", "3", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "layout.dp_size" in err and "Traceback" not in err
    assert not (tmp_path / "bad.toml").exists()


def test_a_failing_hypothesis_example_becomes_a_replayable_case_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHARNESS_FAILURE_DIR", str(tmp_path))
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_x.py::test_planted (call)")

    @settings(max_examples=200, derandomize=True, database=None, deadline=None)
    @given(st.data())
    def planted(data):  # a planted "property": fails whenever any DP group has more than 2 requests
        layout = data.draw(layouts(max_world=4))
        spec = data.draw(specs())
        schedule = data.draw(schedules(layout, max_bs=spec.max_running_requests))
        with failure_case(layout, spec, schedule, prop="P0"):
            assert max(max(s) for s in schedule) <= 2, f"planted failure: a group with {max(max(s) for s in schedule)} requests"

    with pytest.raises(AssertionError) as info:
        planted()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    path = tmp_path / "failure_test_planted.toml"
    assert "written as a case file: " in notes and f"harness replay {path}" in notes and "@example(layout=ParallelLayout(" in notes
    case = load_case(path)  # the shrunk example, ready to replay
    assert max(max(s) for s in case.schedule) == 3  # shrunk to the boundary
    assert sum(sum(s) for s in case.schedule) == 3 and len(case.schedule) == 1
    text = path.read_text()
    assert "planted failure" in text and "harness golden record" in text and "NOTE" not in text

    rep = replay_case(case)  # reruns it; (here the graph falls back to eager: 3 requests, one bucket of 1, and P3 says so)
    assert rep.report.runs is not None and len(rep.report.runs[0].rids) == 1
    assert rep.report.runs[0].rids[0] == [0, 1, 2]


def test_write_failure_case_from_a_scenario_keeps_the_exact_requests(tmp_path):
    layout = ParallelLayout(4, 2, True)
    its = (Iteration(((RequestSpec(17, 5, 2),), (RequestSpec(3, 9, 4), RequestSpec(40, 1, 1)))), Iteration(((), (RequestSpec(17, 6, 3),))))
    sc = Scenario(ModelConfig(), SpecConfig(capture_bs=(1, 2, 4), max_running_requests=4), layout, its, seed=5)
    path = write_failure_case(scenario=sc, prop="P4", message="boom\nsecond line", name="from_scenario", directory=tmp_path)
    case = load_case(path)
    assert case.scenario.iterations == its and case.scenario.layout == layout and case.scenario.seed == 5
    assert "# failure: boom" in path.read_text()
