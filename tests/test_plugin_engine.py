"""engine-check from an engine team's pytest: `--specharness-engine-check` turns a check of their build into items.

The external project (tests/external_project) is run with the option pointing at installed SGLang
releases: 0.5.13.post1 carries the seed bug in its multi-layer runner's attn-TP gather branch,
0.5.14 is the first release without it (tests/test_engine_check.py holds both verdicts on the CLI).
"""
from __future__ import annotations

import json
import re
import shutil
import textwrap
from types import SimpleNamespace

import pytest

from harness.plugin import engine as plugin_engine
from tests.helpers.engine_releases import installed_release
from tests.helpers.prewarmed import run_module
from tests.test_plugin import PROJECT, counts, pytest_in

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def project(tmp_path):
    return shutil.copytree(PROJECT, tmp_path / "project", ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))


def _items(out: str, outcome: str) -> set[str]:
    return {ln.split(" ", 1)[1].split(" - ")[0] for ln in out.splitlines() if ln.startswith(outcome + " ")}


@pytest.mark.engine
def test_seed_bug_release_fails_its_attn_tp_gather_multi_layer_items_only(project):
    target = installed_release("0.5.13.post1")
    rc, out = pytest_in(project, "-k", "engine-check", "-rA", f"--specharness-engine-check=--engine sglang --target {target}")
    assert rc == 1, out[-3000:]
    failed = _items(out, "FAILED")
    # the seed bug lives in the multi-layer runner's attn-TP gather branch: its two layouts, nothing else
    assert failed == {".::specharness::engine-check::multi_layer[tp4-dense_tp1]",
                      ".::specharness::engine-check::multi_layer[tp4-dp2-dense_tp1-dp_lm_head-a2a_deepep]"}, failed
    assert "P1/I1 global_num_tokens_for_logprob_gpu: expected [16], got [4]" in out
    assert "Traceback" not in out
    passed = _items(out, "PASSED")
    assert ".::specharness::engine-check::single_layer[tp4-dense_tp1]" in passed
    assert ".::specharness::engine-check::multi_layer[tp4]" in passed
    # what the check did not check is skipped with its reason, never passed
    skipped = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]
    assert any("not checked: I7 (eager vs graph): not run" in ln for ln in skipped), skipped


@pytest.mark.engine
def test_fixed_release_passes_every_item_and_skips_what_it_did_not_check(project):
    target = installed_release("0.5.14")
    rc, out = pytest_in(project, "-k", "engine-check", "-rA", f"--specharness-engine-check=--engine sglang --target {target}")
    assert rc == 0, out[-3000:]
    c = counts(out)
    # 4 runners (multi-layer, single-layer, draft decode, target verify) x 5 representative layouts
    assert c["passed"] == 20 and c.get("failed", 0) == 0 and c["skipped"] >= 1, c
    assert re.search(r"PASSED \.::specharness::engine-check::target_verify\[tp4-dp2\]", out), out[-3000:]


def test_bad_engine_check_arguments_are_a_usage_error_at_startup(project):
    rc, out = pytest_in(project, "--specharness-engine-check=--engine sglang --no-such-flag")
    assert rc == 4 and "--specharness-engine-check='--engine sglang --no-such-flag': " in out and "--no-such-flag" in out, out[-2000:]
    rc, out = pytest_in(project, "--specharness-engine-check=--engine sglang --releases all")
    assert rc == 4 and "a session checks one engine build" in out, out[-2000:]


def test_an_engine_that_cannot_be_checked_is_a_collection_error_saying_why(project, tmp_path):
    rc, out = pytest_in(project, "-k", "engine-check", f"--specharness-engine-check=--engine sglang --target {tmp_path / 'nowhere'}")
    assert rc == 2, out[-3000:]  # pytest: errors during collection
    assert "could not check the engine (exit 2)" in out and "no sglang package under" in out, out[-3000:]
    assert "Traceback" not in out


@pytest.mark.parametrize("args", [["--engine", "sglang", "--target", "/nowhere"], ["--engine", "sglang==0.0.1"],
                                  ["--engine", "vllm==0.34.0", "--eager"], ["--engine", "vllm==0.0.1"],
                                  ["--engine", "vllm", "--target", "/nowhere"]])
def test_the_module_entry_point_writes_one_json_document_when_it_cannot_check(args):
    """What the plugin runs (`python -m harness.engines ... --json`): an engine it cannot check still ends in the
    harness's error document on stdout (exit 2), with the message on stderr, as `harness engine-check` does."""
    p = run_module("harness.engines", *args, "--json", timeout=120)
    doc = json.loads(p.stdout)
    assert p.returncode == 2 and doc["ok"] is False and doc["exit_code"] == 2 and doc["error"]["kind"] == "bad-input", p.stdout
    assert f"error: {doc['error']['message']}" in p.stderr


# `harness engine-check --engine vllm==0.29.0 --json` (exit 3), as it printed on 2026-12-05: a release the adapter
# does not reach. Fed to the plugin in place of running the check, so this branch needs no 500 MB wheel in CI.
NOT_COVERED = (3, {"engine": "vllm", "version": "0.29.0", "ok": None,
                   "not_covered": "vllm 0.29.0 carries model runner v2's EAGLE speculator graph path (...), but its draft "
                                  "decode runs its own DP collective inside propose() (...); the adapter drives the reused "
                                  "agreement (from 0.30)"})


def test_a_release_outside_the_adapters_reach_is_one_skipped_item_with_the_reason(monkeypatch):
    monkeypatch.setattr(plugin_engine, "run_engine_check", lambda args: NOT_COVERED)
    node = SimpleNamespace(args=["--engine", "vllm==0.29.0"])
    made = []
    monkeypatch.setattr(plugin_engine.NotCheckedItem, "from_parent", classmethod(lambda cls, parent, **kw: made.append(kw) or kw))
    items = list(plugin_engine.EngineCheckNode.collect(node))
    assert [kw["name"] for kw in items] == ["n/a"]
    assert made[0]["reason"].startswith("vllm 0.29.0: vllm 0.29.0 carries model runner v2's EAGLE speculator graph path")


def _line(runner: str, layout: str, path: str, failures: list[dict]) -> dict:
    return {"runner": runner, "step": 0, "branch": layout.split("[")[1].rstrip("]"), "layout": layout, "path": path, "bucket": 2,
            "tokens_per_bs": 4, "raw_bs": [1, 2], "ranks": [0], "pruned_logits": False, "ok": not failures, "checked": 10,
            "failures": failures, "notes": []}


def _failure(check: str, field: str, mark: str) -> dict:
    return {"prop": "P1", "check": check, "field": field, "where": {"runner": "multi_layer", "iteration": 2}, "expected": 0, "got": 7,
            "detail": "", "baseline": mark}


# What `engine-check ... --baseline known.json --json` hands the plugin (the shape drive.py writes; its values made up): an NPU
# line whose failure is known, a GPU line that passed, a path-free line with a new failure, and a stale baseline entry.
PATHS_AND_BASELINE = {
    "engine": "sglang", "version": "0.5.23", "location": "/nowhere", "ok": False, "skipped": [],
    "baseline": {"file": "known.json", "ok": False, "new": 1, "known": 1, "new_findings": [], "not_checked": [],
                 "stale": [{"prop": "P1", "check": "canonical", "field": "seq_lens", "runner": "multi_layer", "step": 0}]},
    "lines": [_line("multi_layer", "tp4-dp2 [mlp_tp_gather]", "npu", [_failure("stale slot", "out_cache_loc", "known")]),
              _line("multi_layer", "tp4 [neither]", "gpu", []),
              _line("single_layer", "tp4-dp2 [mlp_tp_gather]", "", [_failure("I1", "global_num_tokens_gpu", "new")])],
}


def test_items_per_device_path_carry_its_marker_and_known_findings_are_expected_failures(project):
    """A device path's lines are items of their own, named and marked by the path, so `-m "not npu"` (or -k) deselects the NPU
    path; with --baseline an item whose failures are all known xfails, one with a new failure fails, a stale entry warns."""
    (project / "engine-check.json").write_text(json.dumps(PATHS_AND_BASELINE))
    (project / "conftest.py").write_text((project / "conftest.py").read_text() + textwrap.dedent("""
        import json
        from pathlib import Path
        import harness.plugin.engine as engine_items  # the check's JSON document, canned: no engine runs here
        engine_items.run_engine_check = lambda args: (1, json.loads((Path(__file__).parent / "engine-check.json").read_text()))
    """))
    arg = "--specharness-engine-check=--engine sglang --target /nowhere --baseline known.json"
    rc, out = pytest_in(project, "-k", "engine-check", "-rA", "--strict-markers", arg)
    assert rc == 1, out[-3000:]
    assert _items(out, "XFAIL") == {".::specharness::engine-check::multi_layer[tp4-dp2-npu]"}, out[-3000:]
    assert _items(out, "PASSED") == {".::specharness::engine-check::multi_layer[tp4-gpu]"}, out[-3000:]
    assert _items(out, "FAILED") == {".::specharness::engine-check::single_layer[tp4-dp2]"}, out[-3000:]
    assert "1 known finding(s) (baseline known.json)" in out and "a stale entry (checked, no longer found)" in out, out[-3000:]
    # the marker deselects the NPU path (so does -k "not npu": the item's name says npu)
    rc, out = pytest_in(project, "-k", "engine-check", "-m", "not npu", "-rA", "--strict-markers", arg)
    assert not _items(out, "XFAIL") and _items(out, "PASSED") == {".::specharness::engine-check::multi_layer[tp4-gpu]"}, out[-3000:]
