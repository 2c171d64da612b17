"""A failed `harness check` ends with each failed case and the command that shows its first failure; `-k` and `--lf`
select cases as pytest selects tests; `harness golden check` counts differing keys right and shows the values."""
from __future__ import annotations

import json
import shlex

import pytest

from harness.cli import main
from harness.cli.select import CACHE_DIR, keyword_matcher, last_failed
from harness.errors import UsageError

SEED_BUG = "sglang-26416"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --lf's cache is written to the working directory, as pytest's


def test_a_failed_check_ends_with_a_replay_line_per_failed_case_that_shows_the_failure(capsys):
    assert main(["check", "tp1_neither", "tp4_attn_tp_gather", "--mutant", SEED_BUG]) == 1
    out = capsys.readouterr().out
    summary = out[out.index("failed (1)"):]
    assert "tp1_neither" not in summary  # the oracle layout holds: not listed
    # the seed bug breaks the attn-TP gather's capture on every rank from the first step: rank 0, step 0 comes first
    line = f"harness replay tp4_attn_tp_gather --step 0 --rank 0 --mutant {SEED_BUG}"
    assert f"  tp4_attn_tp_gather  P1/I1\n    {line}\n" in summary
    assert "rerun only these: harness check --lf --mutant sglang-26416" in summary and "\n1 passed, 1 failed in " in summary
    assert main(shlex.split(line)[1:]) == 1  # copy-pasted, it shows that failure
    assert "P1/I1  field global_num_tokens_for_logprob_gpu" in capsys.readouterr().out


def test_json_names_the_next_command_of_a_failed_case(capsys):
    assert main(["check", "tp4_attn_tp_gather", "--mutant", SEED_BUG, "--props", "P1", "--json"]) == 1
    (case,) = json.loads(capsys.readouterr().out)["cases"]
    assert case["next"] == f"harness replay tp4_attn_tp_gather --step 0 --rank 0 --mutant {SEED_BUG}"


def test_a_loop_property_failure_points_at_check_with_that_property(capsys):
    assert main(["check", "tp4_attn_tp_gather", "--mutant", SEED_BUG, "--props", "P6"]) == 1
    assert f"harness check tp4_attn_tp_gather --props P6 --mutant {SEED_BUG}" in capsys.readouterr().out


def test_lf_reruns_only_the_cases_that_failed_last(capsys):
    names = ["tp1_neither", "tp4_attn_tp_gather"]
    assert main(["check", *names, "--mutant", SEED_BUG, "--props", "P1"]) == 1
    assert [p.rsplit("/", 1)[-1] for p in sorted(last_failed())] == ["tp4_attn_tp_gather.toml"]
    assert (CACHE_DIR / ".gitignore").read_text().endswith("*\n")
    capsys.readouterr()
    assert main(["check", *names, "--lf", "--props", "P1", "--json"]) == 0  # the mutant gone: the failed one alone, green
    assert [c["case"] for c in json.loads(capsys.readouterr().out)["cases"]] == ["tp4_attn_tp_gather"]
    assert last_failed() == set()
    assert main(["check", *names, "--lf", "--props", "P1"]) == 0  # nothing failed last: all of them, as pytest --lf
    out = capsys.readouterr().out
    assert "--lf: no case failed last time; running all" in out and "2 passed" in out


def test_k_selects_case_names_with_pytests_grammar(capsys):
    names = ["tp4_attn_tp_gather", "tp4_dp2_attn_tp_gather", "tp1_neither", "tp8_neither", "tp2_dp2_mlp_tp_gather"]
    pick = lambda expr: [n for n in names if keyword_matcher(expr)(n)]  # noqa: E731
    assert pick("tp4 and not dp") == ["tp4_attn_tp_gather"]
    assert pick("(tp1 or tp8) and NEITHER") == ["tp1_neither", "tp8_neither"]
    assert pick("mlp or attn and dp2") == ["tp4_dp2_attn_tp_gather", "tp2_dp2_mlp_tp_gather"]  # and binds tighter than or
    for bad in ("tp4 and", "(tp4", "tp4 tp8", "or tp4", ""):
        with pytest.raises(UsageError):
            keyword_matcher(bad)
    assert main(["check", "-k", "tp1_n", "--props", "P1", "--json"]) == 0
    assert [c["case"] for c in json.loads(capsys.readouterr().out)["cases"]] == ["tp1_neither"]
    assert main(["check", "-k", "no_such_thing"]) == 2
    assert "no case selected" in capsys.readouterr().err


def test_golden_check_counts_differing_keys_and_shows_values(capsys):
    assert main(["golden", "check", "tp4_attn_tp_gather", "--mutant", SEED_BUG, "--json"]) == 1
    (case,) = json.loads(capsys.readouterr().out)["cases"]
    stored = {d["key"].split(".meta.")[0] + (".meta" if ".meta." in d["key"] else "") for d in case["diffs"]}
    assert case["differing_keys"] == len(stored) <= case["keys"]  # a packed .meta key counts once, however many fields moved
    logits = next(d for d in case["diffs"] if d["key"] == "r0.i0.s0.logits")
    assert len(logits["first_values"]) == len(logits["first_indices"]) == 3
    assert all(got == 0.0 and want != 0.0 for want, got in logits["first_values"])  # the seed bug zeroes the rows past bs
    assert main(["golden", "check", "tp4_attn_tp_gather", "--mutant", SEED_BUG]) == 1
    out = capsys.readouterr().out
    assert f"{case['differing_keys']} of {case['keys']} keys differ" in out
    want = logits["first_values"][0][0]
    # the seed bug: global_num_tokens_for_logprob holds bs (4) instead of bs * 4 tokens, so logits rows from 4 on are zero
    assert logits["first_indices"][0] == [4, 0]
    assert f"at (4, 0) expected {want:.6g}, got 0;" in out
