"""The pytest plugin and the public API, as an engine team uses them.

tests/external_project is such a team's project: its own pytest.ini, and a conftest.py whose one
line enables harness.plugin. It is copied to tmp_path and run with `python -m pytest` in a process of
its own (forked from tests/helpers/prewarmed.py's server, so torch is imported once per worker), so its
.pytest_cache (what --lf reads) and any goldens it writes stay out of the repo.
"""
import os
import re
import shutil
from pathlib import Path

import pytest

import harness
from harness.cases.case import CASES_DIR
from harness.cli import main
from harness.golden import GOLDEN_DIR
from tests.helpers.prewarmed import run_module

REPO = Path(__file__).resolve().parent.parent
PROJECT = Path(__file__).resolve().parent / "external_project"
SHIPPED_ITEMS = 4 * len(list(CASES_DIR.glob("*.toml")))  # P1, P3, P4 and golden per case


@pytest.fixture
def project(tmp_path):
    dst = tmp_path / "project"
    shutil.copytree(PROJECT, dst, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    return dst


def pytest_in(project: Path, *args: str):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    p = run_module("pytest", "-q", "-p", "no:randomly", *args, cwd=project, env=env, fresh=("harness",), timeout=280)
    return p.returncode, p.stdout + p.stderr


def counts(out: str) -> dict[str, int]:
    summary = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|failed|deselected|error)", ln)][-1]
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|deselected|errors?|skipped)", summary)}


def test_one_conftest_line_enables_the_plugin():
    lines = [ln for ln in (PROJECT / "conftest.py").read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines == ['pytest_plugins = ["harness.plugin"]  # specharness: every (case x property) of the shipped cases as a test']


def test_k_selects_a_case_and_lf_reruns_only_what_failed(project):
    rc, out = pytest_in(project, "-k", "tp4_attn_tp_gather or test_engine", "-rA")
    assert rc == 0, out[-3000:]
    assert counts(out) == {"passed": 6, "deselected": SHIPPED_ITEMS + 2 - 6}
    for prop in ("P1", "P3", "P4", "golden"):
        assert f"PASSED .::specharness::tp4_attn_tp_gather::{prop}" in out

    # the seed bug planted: tp4_attn_tp_gather's items fail, tp1_neither's (the oracle layout) pass
    rc, out = pytest_in(project, "-k", "tp4_attn_tp_gather or tp1_neither", "--specharness-mutant", "sglang-26416")
    assert rc == 1 and counts(out) == {"failed": 4, "passed": 4, "deselected": SHIPPED_ITEMS + 2 - 8}, out[-3000:]
    assert "P1/I1 global_num_tokens_for_logprob_gpu: expected [16], got [4]" in out
    assert "Traceback" not in out  # a property failure reads as its verdict

    rc, out = pytest_in(project, "--lf", "-rA")  # the mutant gone: only the four failures rerun, and pass
    assert rc == 0 and counts(out) == {"passed": 4, "deselected": SHIPPED_ITEMS + 2 - 4}, out[-3000:]
    assert {ln.split("::")[-1] for ln in out.splitlines() if ln.startswith("PASSED")} == {"P1", "P3", "P4", "golden"}


def test_force_regen_is_refused_under_xdist_and_bad_options_are_usage_errors(project):
    rc, out = pytest_in(project, "-n", "2", "--specharness-force-regen", "--collect-only")
    assert rc == 4 and "refused under pytest-xdist" in out, out[-2000:]
    rc, out = pytest_in(project, "--specharness-props", "P9", "--collect-only")
    assert rc == 4 and "unknown: P9" in out, out[-2000:]
    rc, out = pytest_in(project, "--specharness-mutant", "no-such", "--collect-only")
    assert rc == 4 and "unknown mutant" in out, out[-2000:]


def test_the_new_case_walkthrough_leaves_check_and_pytest_green(project, monkeypatch, capsys):
    """The walkthrough as the docs give it, in a project of its own: add a case with its goldens, check it with every
    property, and run the project's pytest (its ini naming the cases dir). Every golden the case's checks
    read (arrays for the golden item, acceptance for P6) was recorded by new-case --record. (In this repository the
    same walkthrough writes to cases/ and golden/: tests/test_golden.py holds every shipped case to having its goldens.)"""
    monkeypatch.chdir(project)
    assert main(["new-case", "tp2_dp2_mine", "--tp", "2", "--dp", "2", "--dir", "cases", "--record"]) == 0
    out = capsys.readouterr().out
    assert "next: harness check tp2_dp2_mine --cases-dir cases --props all" in out and "still missing" not in out
    assert main(["check", "--cases-dir", "cases", "--props", "all"]) == 0
    assert "1 passed, 0 failed" in capsys.readouterr().out
    with open(project / "pytest.ini", "a") as ini:
        ini.write("specharness_cases_dir = cases\nspecharness_props = all\n")
    rc, out = pytest_in(project, "-k", "not test_engine", "-rA")
    assert rc == 0 and counts(out)["passed"] == 7, out[-3000:]  # P1..P6 and its golden item
    assert {ln.rsplit("::", 1)[-1] for ln in out.splitlines() if ln.startswith("PASSED .::specharness::tp2_dp2_mine::")} == {
        "P1", "P2", "P3", "P4", "P5", "P6", "golden"}


# ---------------------------------------------------------------------------------------
# the public API
# ---------------------------------------------------------------------------------------


def readme_api_example() -> str:
    text = (REPO / "README.md").read_text()
    m = re.search(r"<!-- api-example -->\n```python\n(.*?)```", text, re.S)
    assert m, "README.md lost its API example (marked <!-- api-example -->)"
    return m.group(1)


def test_readme_api_example_runs():
    code = readme_api_example()
    assert len(code.strip().splitlines()) <= 12
    exec(compile(code, "README.md:api-example", "exec"), {})


def test_public_api_is_what_all_names():
    assert sorted(harness.__all__) == sorted(set(harness.__all__))
    for name in harness.__all__:
        assert hasattr(harness, name), name
    assert {m.id for m in harness.MUTANTS} >= {"sglang-26416"}


def test_force_regen_with_a_mutant_exits_2_before_anything_runs(project):
    rc, out = pytest_in(project, "--specharness-force-regen", "--specharness-mutant", "sglang-26416", "-k", "tp1_neither and golden")
    assert rc == 2, out[-2000:]
    assert "--specharness-force-regen is refused with --specharness-mutant sglang-26416" in out and "passed" not in out


def test_force_regen_never_rewrites_the_shipped_goldens_and_writes_the_users_beside_their_cases(project, tmp_path):
    """The issue: from a project of its own, force-regen overwrote the shipped golden; with --specharness-cases-dir the
    goldens still went to the shipped folder and the hinted command failed. Force-regen rewrites the goldens (the array
    golden into --specharness-golden-dir when given, P6's beside the case, where P6 reads it) and fails their items, as
    pytest-regressions' --force-regen does; the next run passes."""
    shipped = {p: p.read_bytes() for p in [GOLDEN_DIR / "tp1_neither.npz", GOLDEN_DIR / "tp1_neither.json", GOLDEN_DIR / "acceptance" / "tp1_neither.json"]}
    rc, out = pytest_in(project, "--specharness-force-regen", "-k", "tp1_neither and golden")
    assert rc == 1 and "refusing to write into" in out and "--specharness-cases-dir DIR" in out, out[-2000:]
    assert {p: p.read_bytes() for p in shipped} == shipped

    cases, arrays = tmp_path / "mycases", tmp_path / "arrays"
    cases.mkdir()
    shutil.copy(CASES_DIR / "tp1_neither.toml", cases)
    # DIR joined with '=': a separate path argument would be taken for a test path before the conftest loads the plugin
    rc, out = pytest_in(project, f"--specharness-cases-dir={cases}", "-k", "golden and not test_engine")
    assert rc == 1 and "no golden" in out and f"harness golden record tp1_neither --cases-dir {cases}" in out, out[-2000:]
    dirs = (f"--specharness-cases-dir={cases}", f"--specharness-golden-dir={arrays}", "--specharness-props=all")
    rc, out = pytest_in(project, *dirs, "--specharness-force-regen", "-k", "golden and not test_engine")
    assert rc == 1 and "new golden" in out and "rerun without --specharness-force-regen" in out, out[-2000:]
    assert (arrays / "tp1_neither.npz").is_file() and (cases / "golden" / "acceptance" / "tp1_neither.json").is_file()
    rc, out = pytest_in(project, *dirs, "-k", "tp1_neither and not test_engine")
    assert rc == 0 and counts(out)["passed"] == 7, out[-2000:]  # P1..P6 and golden, each finding its golden
    assert {p: p.read_bytes() for p in shipped} == shipped
