"""`harness engine-check --engine vllm --releases ...`: one table over vLLM releases, each verdict
the one the release's source calls for.

Expected rows, read from the wheels: 0.11.2 has no model runner v2 EAGLE speculator
(vllm/v1/worker/gpu/ has no spec_decode/eagle*): N/A, no path. 0.24.0 has the path but captures the
draft prefill graphs from the target's captured attention states
(PrefillSpeculatorCudaGraphManager.capture(attn_states=...)): N/A, an older capture protocol.
0.27.0 and 0.28.0 are driven (token-keyed, the target's decode query length GPUModelRunner's
own) and pass under their own dispatch order: their CudaGraphManager keys its dispatch
candidates by the smallest captured token count holding the batch, whatever its mode
(cudagraph_utils.py _init_candidates: descs_by_token_lora), so 4 requests at 3 tokens (12) take
the 16-token PIECEWISE graph while a FULL 6-request (18-token) one is captured; 0.29.0 keys them
per mode, FULL first (api.DispatchOrder). Copies of 0.28.0 with a one-line bug each (the model
runner's decode query length one too large; the draft prefill skipping its own DP collective)
fail the checks that own them and no other. 0.29.0 is driven and passes: its
draft decode runs its own DP collective inside propose() (dispatch_cg_and_sync_dp with no dp_sync:
every rank votes its real request count, the agreement takes the largest), so the ranks' propose()
calls run at once and the one-token decode takes the smallest graph holding the largest rank's
requests; a copy of it whose draft decode dispatch skips that collective (dp_size=1) fails on the
draft decode lines only. 0.32.0 is driven (token-keyed capture sizes,
compilation_config.cudagraph_capture_sizes) and fails the padding check: its DPSyncState.num_reqs
holds the target's padded request count (dp_utils.py: "Holds the padded count when a FULL
descriptor imposed one"), which the draft decode pads from, so with 4 requests on the largest
rank the one-token decode takes the 8-request graph while a 4-request one is captured. 0.33.0
(token-keyed, num_reqs the ranks' real maximum) and 0.34.0 (request-keyed) pass. Releases are
installed on first use (cached, locked) where SPECHARNESS_VLLM_TABLE=1 asks for it (tests/helpers/engine_releases.py);
otherwise the table's tests skip saying so.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from harness.engines.command import add_arguments, main
from harness.engines.install import MARKER
from harness.engines.releases import VLLM, json_document, select
from harness.engines.vllm.install import installed_vllm_versions
from harness.engines.vllm.stubs import StubDistributionFinder
from tests.helpers.engine_releases import VLLM_TABLE_ENV, installed_vllm
from tests.helpers.planted import planted_copy

REPO = Path(__file__).resolve().parent.parent
TABLE_RELEASES = ("0.11.2", "0.24.0", "0.27.0", "0.28.0", "0.29.0", "0.32.0", "0.33.0", "0.34.0")


def test_vllm_all_starts_at_the_first_release_with_the_speculator_graphs():
    listed = ["0.11.0", "0.11.1", "0.11.2", "0.12.0", "0.15.1", "0.34.0"]
    assert select("all", lambda: listed, product=VLLM) == ["0.12.0", "0.15.1", "0.34.0"]
    assert select("0.15.1..", lambda: listed, product=VLLM) == ["0.15.1", "0.34.0"]


def test_vllm_releases_refuses_a_pinned_engine():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(parser.parse_args(["--engine", "vllm==0.34.0", "--releases", "all"]))
    assert rc == 2 and "give --engine vllm, without ==VERSION" in err.getvalue()


def testjson_document_after_engine_log_lines():
    out = 'WARNING 12-03 [interface.py:358] Failed to import from vllm._C\n{\n  "ok": null,\n  "x": {\n    "y": 1\n  }\n}\n'
    assert json_document(out) == {"ok": None, "x": {"y": 1}}


def test_stubbed_transformers_reports_the_version_old_releases_require():
    finder = StubDistributionFinder()
    sys.meta_path.insert(0, finder)
    try:
        assert importlib.metadata.version("transformers") == "5.0.0"
    finally:
        sys.meta_path.remove(finder)


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_release_table_verdicts_follow_the_sources():
    """Six more vLLM releases than tests/test_engine_vllm.py needs (0.11.2 .. 0.32.0, about 5.4 GB installed): only
    where installed already or SPECHARNESS_VLLM_TABLE=1 (0.34.0's and 0.33.0's verdicts are checked there)."""
    for v in TABLE_RELEASES:
        installed_vllm(v, VLLM_TABLE_ENV)
    proc = subprocess.run([sys.executable, "-m", "harness.engines", "--engine", "vllm", "--releases", ",".join(TABLE_RELEASES),
                           "--json"], cwd=REPO, capture_output=True, text=True)
    rows = {r["version"]: r for r in json.loads(proc.stdout)}
    assert proc.returncode == 1, proc.stderr[-2000:]  # 0.32.0 fails; N/A rows do not count against the table
    assert rows["0.11.2"]["verdict"] == "N/A" and rows["0.11.2"]["exit_code"] == 3
    assert "has no model-runner-v2 EAGLE speculator graph path" in rows["0.11.2"]["first_failure"]
    assert rows["0.24.0"]["verdict"] == "N/A" and rows["0.24.0"]["exit_code"] == 3
    assert "PrefillSpeculatorCudaGraphManager.capture(attn_states=...)" in rows["0.24.0"]["first_failure"]
    for v in ("0.27.0", "0.28.0"):  # under their own dispatch order (the module docstring)
        assert rows[v]["verdict"] == "PASS" and rows[v]["failures"] == 0 and rows[v]["api"] == "mrv2-tkr"
    assert rows["0.29.0"]["verdict"] == "PASS" and rows["0.29.0"]["failures"] == 0 and rows["0.29.0"]["api"] == "mrv2-tok"
    assert rows["0.32.0"]["verdict"] == "FAIL" and rows["0.32.0"]["api"] == "mrv2-tok"
    assert rows["0.32.0"]["first_failure"].startswith("P1/padding graph (mode, requests): expected ['FULL', 4], got ['FULL', 8]")
    assert "runner=draft_decode" in rows["0.32.0"]["first_failure"]
    assert rows["0.33.0"]["verdict"] == "PASS" and rows["0.33.0"]["failures"] == 0 and rows["0.33.0"]["api"] == "mrv2-tok"
    assert rows["0.34.0"]["verdict"] == "PASS" and rows["0.34.0"]["failures"] == 0 and rows["0.34.0"]["api"] == "mrv2"


# 0.29.0's draft decode dispatch in propose(), as released and with its own DP collective skipped (each rank pads alone)
OWN_AGREEMENT = "uniform_token_count=1,\n            dp_size=self.dp_size,"
OWN_AGREEMENT_SKIPPED = "uniform_token_count=1,\n            dp_size=1,"
_PLANTED = """
from pathlib import Path
import json, sys
from harness.engines.install import deps_dir
from harness.engines.vllm.command import check_vllm
from harness.engines.vllm.config import VllmCheckConfig
from harness.engines.vllm.install import vllm_deps_dir
from harness.engines.vllm.loader import load
rep = check_vllm(load(Path(sys.argv[1]), [deps_dir(), vllm_deps_dir()]), VllmCheckConfig(dp_sizes=(2,), decode_dp_sizes=(), fused_decode=(False,)))
print(json.dumps(rep.to_json(), default=str))
"""


AR_SPECULATOR = "vllm/v1/worker/gpu/spec_decode/autoregressive/speculator.py"
# 0.28.0: GPUModelRunner's decode query length one too large (the target's graphs keyed at 1 + K + 1 tokens per request)
RUNNER_Q = ("vllm/v1/worker/gpu/model_runner.py", "+ self.model_state.num_new_sampled_tokens_per_step\n",
            "+ self.model_state.num_new_sampled_tokens_per_step + 1\n")
# 0.28.0: the draft prefill dispatch skipping its own DP collective (each rank dispatches its own padded count alone)
PREFILL_OWN_AGREEMENT = "num_tokens_padded,\n            uniform_token_count,\n            dp_size=self.dp_size,"
PREFILL_SKIPS_AGREEMENT = (AR_SPECULATOR, PREFILL_OWN_AGREEMENT, PREFILL_OWN_AGREEMENT.replace("self.dp_size", "1"))


def _installed(version: str) -> Path:
    return installed_vllm(version, VLLM_TABLE_ENV)


def _planted_failures(release: Path, copies: dict[str, Optional[tuple[str, str, str]]],
                      tmp_path: Path) -> dict[str, set[tuple[str, str, str]]]:
    """Per copy of `release` with one line replaced (exactly once; None: the release as installed), the (check, field,
    runner) its check failed; the copies are checked at once (one DP 2 world, per-step path), each in its own process."""
    procs = {}
    for name, edit in copies.items():
        planted = release
        if edit is not None:
            rel, old, new = edit
            text = (release / rel).read_text()
            assert text.count(old) == 1, name
            planted = tmp_path / name / release.name
            planted_copy(release, planted, {rel: text.replace(old, new)})
        procs[name] = subprocess.Popen([sys.executable, "-c", _PLANTED, str(planted)], cwd=REPO, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate()
        assert proc.returncode == 0, stderr[-2000:]
        out[name] = {(f["check"], f["field"], f["where"]["runner"]) for ln in json.loads(stdout)["lines"] for f in ln["failures"]}
    return out


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_planted_028_bugs_are_caught(tmp_path):
    failed = _planted_failures(_installed("0.28.0"), {"release": None, "runner_q": RUNNER_Q, "prefill_dp": PREFILL_SKIPS_AGREEMENT},
                               tmp_path)
    assert failed["release"] == set()
    # the target's graphs hold 4 tokens per request while its batches hold 3: captured wrong, and none of them fits a batch,
    # so the verify-width batches (the target's, and the draft prefill's, which reuses its agreement) run other graphs than
    # the release's rule gives for 3-token requests
    assert failed["runner_q"] == {("capture sizes", "uniform_token_count", "target_verify"),
                                  ("capture sizes", "num_tokens", "target_verify"),
                                  ("capture sizes", "request sizes at 1 + K", "target_verify"),
                                  ("padding", "graph (mode, requests)", "target_verify"),
                                  ("padding", "graph (mode, requests)", "draft_prefill")}
    # each rank dispatches the draft prefill alone: no count across DP, and where one rank's batch fits a graph and the
    # other's does not, the ranks run different shapes
    assert failed["prefill_dp"] == {("DP", "num_tokens_across_dp", "draft_prefill"),
                                    ("DP", "(mode, num_tokens) on every rank", "draft_prefill"),
                                    ("I1", "num_tokens_across_dp", "draft_prefill"),
                                    ("padding", "graph (mode, requests)", "draft_prefill")}  # a rank's own graph, not the agreed one


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_planted_029_draft_decode_skipping_its_own_agreement_is_caught(tmp_path):
    copy = {"decode_dp": (AR_SPECULATOR, OWN_AGREEMENT, OWN_AGREEMENT_SKIPPED)}
    failed = _planted_failures(_installed("0.29.0"), copy, tmp_path)["decode_dp"]
    # each rank takes the graph of its own count: the ranks run different shapes, with no count across DP
    assert ("DP", "(mode, num_tokens) on every rank", "draft_decode") in failed
    assert ("DP", "num_tokens_across_dp", "draft_decode") in failed
    assert ("padding", "graph (mode, requests)", "draft_decode") in failed
    assert {runner for _, _, runner in failed} == {"draft_decode"}  # the target's and the draft prefill's agreement are untouched


def test_installed_releases_are_ordered_as_releases_not_as_strings(tmp_path):
    """The newest install is what `--engine vllm` (no version) checks: 0.34.0 comes after 0.9.2, and the deps folder is no release."""
    for name in ("vllm-0.9.2", "vllm-0.34.0", "vllm-0.12.0", "vllm-deps", "vllm-0.35.0"):
        (tmp_path / name).mkdir()
        if name != "vllm-0.35.0":  # an unfinished install has no marker
            (tmp_path / name / MARKER).write_text("")
    assert installed_vllm_versions(tmp_path) == ["0.9.2", "0.12.0", "0.34.0"]
