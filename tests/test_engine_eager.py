"""I7 on SGLang's own eager draft-extend path (harness/engines/sglang/eager.py, eager_check.py).

The engine's eager batch comes from the scheduler's MLP sync (a decode batch counts requests)
scaled by the worker's widths (num_tokens_per_req = T, num_tokens_for_logprob_per_req = 1), and
its worker prunes logits to a row per request only where the graph runner prunes (no gathered
buffer). So in the gathered branches it reports bs_r for_logprob rows while its logits processor
hands lm_head all bs_r * T: read from the sources of NEWEST (multi_layer_eagle_worker_v2.
_draft_extend_for_decode, spec_info.spec_scale_global_num_tokens, scheduler_components/dp_attn.
prepare_mlp_sync_batch_raw), asserted here as numbers, never computed by the code under test.
A bug planted into a copy of NEWEST (for_logprob scaled by tokens) is caught on I7 lines only.
"""
from __future__ import annotations

import argparse
import json
import os
import textwrap
from pathlib import Path

import pytest

from harness.engines import command
from tests.helpers.engine_releases import installed_release
from tests.helpers.planted import planted_copy
from tests.helpers.prewarmed import run_python
from tests.helpers.shared import computed_once

NEWEST = os.environ.get("SPECHARNESS_SGLANG_NEWEST", "0.5.23")
T = 4  # num_draft_tokens of harness.engines.sglang.config.EngineConfig
SPEC_INFO = "sglang/srt/speculative/spec_info.py"
# MLP-TP gather (two DP groups: one goes idle), attn-TP gather, plain TP, DP attention with dp = tp (neither)
LAYOUTS = "ParallelLayout(4, 2, True), ParallelLayout(4, 1, False, 1), ParallelLayout(4), ParallelLayout(4, 4, True, 1, True, 'deepep')"

pytestmark = pytest.mark.timeout(900)


def _check(target: Path) -> dict:
    code = f"""
        import json
        from pathlib import Path
        from harness.engines.check import check_engine
        from harness.engines.install import deps_dir
        from harness.engines.sglang.loader import load
        from runners.parallel.layout import ParallelLayout
        eng = load(Path({str(target)!r}), deps_dir())
        print(json.dumps(check_engine(eng, ({LAYOUTS}), kernel_layouts=(), eager=True).to_json(), default=str))
    """
    proc = run_python(textwrap.dedent(code), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def newest(tmp_path_factory) -> dict:
    return computed_once(tmp_path_factory, f"sglang-{NEWEST}-eager", lambda: _check(installed_release(NEWEST)))


def _eager(rep: dict) -> list[dict]:
    return [ln for ln in rep["lines"] if ln["runner"] == "eager"]


def _graph_kinds(rep: dict) -> set[tuple]:
    return {(f["check"], f["field"], ln["runner"], f["where"].get("path", "")) for ln in rep["lines"] if ln["runner"] != "eager"
            for f in ln["failures"]}


@pytest.mark.engine
def test_newest_eager_path_reports_requests_against_every_token_in_the_gathered_branches(newest):
    assert not any(why.startswith("I7") for why in newest["skipped"]), newest["skipped"]
    eager = _eager(newest)
    assert {ln["layout"] for ln in eager} == {ln["layout"] for ln in newest["lines"]}  # every layout has its eager lines
    for ln in eager:
        gathered = ln["branch"] != "neither"
        assert ln["ok"] is not gathered, ln
        assert ln["pruned_logits"] is not gathered, ln  # the worker prunes exactly where the graph runner does
        for f in ln["failures"]:
            if f["check"] == "dp-gather":
                # the engine's own DP gather on the eager batch (tp4-dp2 gathers): each rank's first bs_r rows come back,
                # rows [bs_r, bs_r * T) are zero
                assert ln["branch"] == "mlp_tp_gather" and f["where"]["row"] == f["where"]["raw_bs"], f
                assert f["got"].startswith("a zero row"), f
                continue
            assert f["check"] == "I7", f
            if f["field"] == "global_num_tokens_for_logprob (eager)":
                # one logprob row per request, against the bs_r * T rows lm_head is handed
                assert f["expected"] == T * f["got"] == T * f["where"]["raw_bs"], f
    # I7 failures sit on eager lines only, never on a graph runner's
    assert not any(f["check"] == "I7" for ln in newest["lines"] if ln["runner"] != "eager" for f in ln["failures"])
    # the schedule reached an idle DP group in the MLP-TP gather layout, which counts nothing; the gather ran there
    mlp = [ln for ln in eager if ln["branch"] == "mlp_tp_gather"]
    assert any(0 in ln["raw_bs"] for ln in mlp), mlp
    gathered = [f["where"]["dp_sizes"] for ln in mlp for f in ln["failures"] if f["check"] == "dp-gather"]
    assert any(0 in d for d in gathered) and any(0 not in d for d in gathered), gathered
    # plain TP: no MLP sync, no DP counts on either path (one check per load, absent = absent)
    plain = [ln for ln in eager if ln["layout"].startswith("tp4 [")]
    assert plain and all(ln["ok"] and ln["checked"] >= 1 for ln in plain), plain


@pytest.mark.engine
def test_a_bug_planted_in_the_eager_count_scaling_is_caught_on_eager_lines_only(newest, tmp_path):
    """for_logprob scaled by the tokens per request: the gathered branches now agree (every token reaches lm_head),
    the pruned branch (one row per request) fails on I7; no graph runner's line changes."""
    src = installed_release(NEWEST)
    old = "x * spec_info.num_tokens_for_logprob_per_req"
    text = (src / SPEC_INFO).read_text()
    if text.count(old) != 1:
        pytest.skip(f"sglang {NEWEST}: {SPEC_INFO} does not have {old!r} exactly once")
    dst = tmp_path / "planted"
    planted_copy(src, dst, {SPEC_INFO: text.replace(old, "x * spec_info.num_tokens_per_req")})
    rep = _check(dst)
    assert _graph_kinds(rep) == _graph_kinds(newest)
    for ln in _eager(rep):
        assert not any(f["check"] == "dp-gather" for f in ln["failures"]), ln  # every row now reaches the gather
        if ln["layout"].startswith("tp4 ["):
            assert ln["ok"], ln  # plain TP: no MLP sync, so no counts to scale
            continue
        assert ln["ok"] is (ln["branch"] != "neither"), ln
        for f in ln["failures"]:
            assert f["check"] == "I7" and f["where"]["branch"] == "neither", f
            if f["field"] == "global_num_tokens_for_logprob (eager)":
                assert f["got"] == T * f["expected"] == T * f["where"]["raw_bs"], f  # tokens counted, one row per request fed


def test_eager_flag_reaches_check_engine_and_is_refused_for_vllm(monkeypatch):
    """`--eager` is the CLI's way to I7 on SGLang; on vLLM, which has no eager check, it is an error, not ignored."""
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert command.main(parser.parse_args(["--engine", "vllm==0.34.0", "--eager"])) == 2
    seen = {}
    monkeypatch.setattr(command, "_resolve", lambda args: (None, None))
    monkeypatch.setattr(command, "drive_engine", lambda spec, load, check, fmt, as_json, baseline: seen.setdefault("check", check) and 0)
    monkeypatch.setattr(command, "check_engine", lambda engine, layouts, cfg, progress, eager, selection: seen.setdefault("eager", eager))
    assert command.main(parser.parse_args(["--engine", "sglang==0.5.23", "--eager"])) == 0
    seen["check"](None, None)
    assert seen["eager"] is True
