"""The `harness` command as a user runs it: exit codes, the first divergence, JSON shapes."""
import json
import subprocess
import sys

import pytest

from harness.cli import main


def run(*args):
    p = subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=240)
    return p.returncode, p.stdout, p.stderr


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("list", "check", "replay", "mutants"):
        assert cmd in out


def test_list_shows_layout_and_branch(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "tp4_attn_tp_gather" in out and "[attn_tp_gather]" in out and "[mlp_tp_gather]" in out and "[neither]" in out


def test_check_one_case_passes(capsys):
    assert main(["check", "tp2_neither"]) == 0
    out = capsys.readouterr().out
    assert "PASS tp2_neither" in out and "1 passed, 0 failed" in out


def test_check_props_all_runs_the_loop_properties_and_names_what_it_skips(capsys):
    assert main(["check", "tp1_neither", "tp2_attn_tp_gather_explicit", "--props", "all", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    full, skipped = data["cases"]
    assert set(full["properties"]) == {"P1", "P2", "P3", "P4", "P5", "P6"} and full["skipped"] == {}
    assert all(v["ok"] for v in full["properties"].values())
    assert set(skipped["properties"]) == {"P1", "P3", "P4"}  # T = 5 with num_steps 3: the loop can't run it
    assert set(skipped["skipped"]) == {"P2", "P5", "P6"} and "num_tokens_per_bs must be 4, got 5" in skipped["skipped"]["P5"]
    assert main(["check", "tp2_attn_tp_gather_explicit", "--props", "P5"]) == 0
    out = capsys.readouterr().out
    assert "P5:skip" in out and "skipped P5: the loop verifies" in out


def test_check_props_kill_the_seed_bug_through_p6(capsys):
    assert main(["check", "tp4_attn_tp_gather", "--props", "P6", "--mutant", "sglang-26416"]) == 1
    assert "P6:FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("argv,msg", [
    (["--props", "P9"], "expected 'all' or a comma list of P1, P3, P4, P2, P5, P6; unknown: P9"),
    (["--props", ","], "none given"),
    (["--props", "P2", "--ranks", "gloo"], "simulated ranks only"),
])
def test_check_props_errors_name_what_is_accepted(argv, msg):
    with pytest.raises(SystemExit) as e:
        main(["check", "tp1_neither", *argv])
    assert msg in str(e.value)


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
