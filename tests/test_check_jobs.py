"""`harness check --jobs N`: cases in forked workers report exactly what one process reports, in the cases' order, and a
planted mutant is planted in every worker (each process runs its own copy of the code)."""
from __future__ import annotations

import json

from harness.cli import main

# two small cases of two branches: the seed bug lives in the attn-TP-gather one only
CASES = ["tp2_shrink", "tp2_neither"]


def _check(capsys, *extra: str) -> tuple[int, dict]:
    rc = main(["check", *CASES, "--json", *extra])
    return rc, json.loads(capsys.readouterr().out)


def _verdicts(doc: dict) -> list[tuple[str, str, dict]]:
    """Per case: its name, status and each property's failures (timings aside)."""
    return [(c["case"], c["status"], {k: v["failures"] for k, v in c["properties"].items()}) for c in doc["cases"]]


def test_two_workers_report_what_one_process_reports(capsys):
    rc1, one = _check(capsys, "--jobs", "1")
    rc2, two = _check(capsys, "--jobs", "2")
    assert (rc1, rc2) == (0, 0)
    assert [c["case"] for c in two["cases"]] == CASES  # the cases' order, whatever order the workers finished in
    assert _verdicts(two) == _verdicts(one)


def test_a_mutant_is_planted_in_every_worker(capsys):
    rc, doc = _check(capsys, "--jobs", "2", "--mutant", "sglang-26416")
    assert rc == 1
    status = {c["case"]: c["status"] for c in doc["cases"]}
    assert status == {"tp2_shrink": "fail", "tp2_neither": "pass"}  # the attn-TP-gather branch only
    failed = next(c for c in doc["cases"] if c["case"] == "tp2_shrink")
    fields = {f["field"] for v in failed["properties"].values() for f in v["failures"]}
    assert "global_num_tokens_for_logprob_gpu" in fields


def test_jobs_below_one_is_a_usage_error(capsys):
    assert main(["check", *CASES, "--jobs", "0"]) == 2
    assert "--jobs must be >= 1 (got 0)" in capsys.readouterr().err


def test_one_case_runs_in_this_process_with_its_progress(capsys):
    assert main(["check", "tp2_shrink", "--jobs", "2"]) == 0
    captured = capsys.readouterr()
    assert "at once" not in captured.err and "... " in captured.err  # one case: no workers, its progress on stderr
