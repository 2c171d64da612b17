"""The `harness` command as a user runs it: exit codes, the first divergence, JSON shapes.

`run` is `python -m harness.cli` in a process of its own, forked from tests/helpers/prewarmed.py's server
(torch imported once per worker); the installed `harness` script's own cold start is
tests/test_packaging.py's.
"""
import json
import sys

import pytest

from harness.cases.case import CASES_DIR
from harness.cli import main
from tests.helpers.prewarmed import run_module


def run(*args):
    p = run_module("harness.cli", *args, timeout=240)
    return p.returncode, p.stdout, p.stderr


def test_help_lists_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("list", "check", "replay", "mutants"):
        assert cmd in out


def test_python_dash_m_harness_is_the_command_with_its_exit_codes():
    ok = run_module("harness", "list", timeout=240)
    assert ok.returncode == 0 and "tp4_attn_tp_gather" in ok.stdout, ok.stderr
    bad = run_module("harness", "no-such-command", timeout=240)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr, (bad.returncode, bad.stderr)


@pytest.mark.parametrize("flag,value,names", [("--step", "3", "draft steps 0..2"), ("--rank", "2", "ranks 0..1"), ("--rank", "-1", "ranks 0..1")])
def test_replay_refuses_a_step_or_rank_the_case_does_not_run(capsys, flag, value, names):
    """Filtering on a step or rank the case never runs would print an empty table and exit 0."""
    assert main(["replay", "tp2_neither", flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {value}" in err and names in err, err


def test_list_shows_layout_and_branch(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "tp4_attn_tp_gather" in out and "[attn_tp_gather]" in out and "[mlp_tp_gather]" in out and "[neither]" in out


def test_check_one_case_passes(capsys):
    assert main(["check", "tp2_neither"]) == 0
    out = capsys.readouterr().out
    assert "PASS tp2_neither" in out and "1 passed, 0 failed" in out


def test_check_props_all_runs_the_loop_properties_and_names_what_it_skips(capsys, tmp_path):
    assert main(["check", "tp1_neither", "tp2_attn_tp_gather_explicit", "--props", "all", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for case in data["cases"]:  # T = 5 with num_steps 3 and topk 2: a verify tree the loop runs
        assert set(case["properties"]) == {"P1", "P2", "P3", "P4", "P5", "P6"} and case["skipped"] == {}
        assert all(v["ok"] for v in case["properties"].values())
    text = (CASES_DIR / "tp1_neither.toml").read_text().replace("topk = 1", "topk = 2\nnum_tokens_per_bs = 8")
    wide = tmp_path / "tp1_neither.toml"  # 3 steps of topk 2 draft 6 tokens: they cannot fill 8 - 1 verify slots
    wide.write_text(text)
    assert main(["check", str(wide), "--props", "P5"]) == 3  # nothing was checked: never a pass
    out = capsys.readouterr().out
    assert "SKIP tp1_neither" in out and "P5:skip" in out and "num_tokens_per_bs must be in [2, 7], got 8" in out
    assert "0 passed, 0 failed, 1 skipped (nothing checked)" in out
    assert main(["check", str(wide), "tp1_neither", "--props", "P5", "--json"]) == 0  # one case checked, one skipped
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and [c["status"] for c in data["cases"]] == ["skip", "pass"] and not data["cases"][0]["ok"]


def test_check_props_kill_the_seed_bug_through_p6(capsys):
    assert main(["check", "tp4_attn_tp_gather", "--props", "P6", "--mutant", "sglang-26416"]) == 1
    assert "P6:FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("argv,msg", [
    (["--props", "P9"], "expected 'all' or a comma list of P1, P3, P4, P2, P5, P6; unknown: P9"),
    (["--props", ","], "none given"),
    (["--props", "P2", "--ranks", "gloo"], "simulated ranks only"),
])
def test_check_props_errors_name_what_is_accepted(argv, msg, capsys):
    assert main(["check", "tp1_neither", *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_replay_clean_case_exits_0_and_seed_mutant_exits_1():
    rc, out, _ = run("replay", "tp4_attn_tp_gather")
    assert rc == 0, out
    assert "raw_bs->bs" in out and "first divergence" not in out
    rc, out, _ = run("replay", "tp4_attn_tp_gather", "--mutant", "sglang-26416")
    assert rc == 1
    assert "first divergence" in out and "global_num_tokens_for_logprob" in out
    assert "expected [16]" in out and "got      [4]" in out


def test_replay_json(capsys):
    assert main(["replay", "tp1_neither", "--json", "--step", "0"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["first_divergence"] is None
    assert {row["step"] for row in data["steps"]} == {0}


def test_mutants_json_schema(capsys):
    assert main(["mutants", "--only", "bucket-floor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (m,) = data["mutants"]
    assert set(m) >= {"id", "description", "killed", "killed_by", "seconds"}
    assert m["id"] == "bucket-floor" and m["killed"] is True and m["killed_by"] == "P1"


def test_unknown_mutant_is_a_clear_error(capsys):
    assert main(["mutants", "--only", "no-such-mutant"]) == 2
    assert "unknown mutant" in capsys.readouterr().err


def test_missing_case_is_a_clear_error(capsys):
    assert main(["check", "no_such_case"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no_such_case" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------
# exit codes: 0 pass, 1 a property failed, 2 bad input or usage, 3 internal error (OOM included)
# ---------------------------------------------------------------------------------------


def one_json(out: str) -> dict:
    """stdout under --json: exactly one JSON document (json.loads refuses trailing text)."""
    return json.loads(out)


def test_version(capsys):
    assert main(["--version"]) == 0
    from harness import __version__

    assert capsys.readouterr().out.strip() == f"harness (specharness) {__version__}"
    rc, out, _ = run("--version")
    assert rc == 0 and __version__ in out


@pytest.mark.parametrize("argv,code,kind", [
    (["check", "tp1_neither", "--json"], 0, None),
    (["check", "tp4_attn_tp_gather", "--mutant", "sglang-26416", "--json"], 1, None),
    (["check", "tp1_neither", "--props", "P9", "--json"], 2, "usage"),
    (["check", "--no-such-flag", "--json"], 2, "usage"),
    (["check", "no_such_case", "--json"], 2, "bad-input"),
    (["list", "no_such_case", "--json"], 2, "bad-input"),
    (["replay", "no_such_case", "--json"], 2, "bad-input"),
    (["check", "tp1_neither", "--mutant", "no-such-mutant", "--json"], 2, "bad-input"),
    (["check", "--rank", "1", "tp1_neither", "--json"], 2, "usage"),  # no abbreviation of --ranks
    (["golden", "check", "tp1_neither", "--golden-dir", "/nonexistent/golden", "--json"], 1, None),
])
def test_json_exit_codes_one_document_for_every_outcome(argv, code, kind, capsys):
    assert main(argv) == code
    cap = capsys.readouterr()
    doc = one_json(cap.out)
    assert doc["ok"] is (code == 0)
    if kind is not None:
        assert doc["exit_code"] == code and doc["error"]["kind"] == kind and doc["error"]["message"]
        assert cap.err.startswith("error: ") and "Traceback" not in cap.err


def test_usage_error_without_json_exits_2_on_stderr(capsys):
    assert main(["check", "--props"]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and "expected one argument" in cap.err


def test_internal_error_exits_3_with_a_traceback_and_json(monkeypatch, capsys):
    import harness.pipeline.check

    def boom(*a, **k):
        raise ZeroDivisionError("a bug of ours")

    monkeypatch.setattr(harness.pipeline.check, "check_case", boom)
    assert main(["check", "tp1_neither", "--json"]) == 3
    cap = capsys.readouterr()
    doc = one_json(cap.out)
    assert doc == {"ok": False, "exit_code": 3, "error": {"kind": "internal", "message": "internal error: ZeroDivisionError: a bug of ours"}}
    assert "Traceback" in cap.err  # ours to fix: the traceback goes with it


def test_out_of_memory_is_its_own_error_never_a_property_failure(monkeypatch, capsys):
    """A rank's MemoryError (CPU) ends the run with exit 3, kind out-of-memory; no verdict is reported."""
    import harness.run.case_run

    def oom(*a, **k):
        raise MemoryError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 40000000000 bytes")

    monkeypatch.setattr(harness.run.case_run, "run_rank", oom)
    assert main(["check", "tp2_neither", "--json"]) == 3
    doc = one_json(capsys.readouterr().out)
    assert doc["error"]["kind"] == "out-of-memory" and "tp2_neither" in doc["error"]["message"]
    assert "cases" not in doc  # no property verdicts for a run that judged nothing
    assert main(["check", "tp2_neither"]) == 3
    cap = capsys.readouterr()
    assert "FAIL" not in cap.out and "out of memory" in cap.err


def test_a_command_reporting_on_stderr_only_still_gives_one_json_document(monkeypatch, capsys):
    """engine-check reports some errors itself (stderr, exit 2): --json still gets its document."""
    import harness.cli

    def quiet(args):
        print("error: the engine is not installed", file=sys.stderr)
        return 2

    parser = harness.cli.build_parser
    monkeypatch.setattr(harness.cli, "build_parser", lambda: _with_func(parser(), quiet))
    assert main(["list", "--json"]) == 2
    assert one_json(capsys.readouterr().out)["error"] == {"kind": "bad-input", "message": "the engine is not installed"}


def _with_func(parser, func):
    for action in parser._subparsers._group_actions:
        for sub in action.choices.values():
            sub.set_defaults(func=func)
    return parser


def test_no_cases_exits_2_saying_where_it_looked(tmp_path, capsys):
    for argv in (["check"], ["list"], ["golden", "check"]):
        assert main([*argv, "--cases-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"looked in {tmp_path} (no *.toml in it)" in err
    assert main(["check", "--cases-dir", str(tmp_path / "nope"), "--json"]) == 2
    assert "(no such directory)" in one_json(capsys.readouterr().out)["error"]["message"]


def test_cases_dir_finds_cases_by_name(tmp_path, capsys):
    from harness.cases.case import CASES_DIR

    (tmp_path / "mine.toml").write_text((CASES_DIR / "tp1_neither.toml").read_text().replace('name = "tp1_neither"', 'name = "mine"'))
    assert main(["list", "--cases-dir", str(tmp_path), "--json"]) == 0
    assert [c["case"] for c in one_json(capsys.readouterr().out)] == ["mine"]
    assert main(["check", "mine", "--cases-dir", str(tmp_path)]) == 0
    assert "PASS mine" in capsys.readouterr().out


def test_exit_codes_through_a_real_process():
    rc, out, err = run("check", "tp1_neither", "--props", "P9", "--json")
    assert rc == 2 and json.loads(out)["error"]["kind"] == "usage" and "Traceback" not in err
    rc, out, err = run("list", "/dev/null", "--json")
    assert rc == 2 and "not a regular file" in json.loads(out)["error"]["message"]
