"""`harness engine-check` against real SGLang releases (issue 11).

The releases are installed side by side (python -m harness.engines.install: one
`pip install --no-deps --target .engines/sglang-VERSION` each, cached by a marker file);
a test whose wheels cannot be installed is skipped with pip's reason. Each check runs in
its own process: the engine adapter stubs imports and swaps module globals process-wide.

  0.5.13.post1  carries the seed bug: the multi-layer runner's attn-TP-gather branch bakes
                global_num_tokens_for_logprob = [bs] where the replay fill says [bs * T]
  0.5.14        the fix
  NEWEST        the newest release the registry served when this was written (0.5.23);
                SPECHARNESS_SGLANG_NEWEST=X.Y.Z checks another one
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.engines.install import EngineSpec
from tests.helpers.engine_releases import installed_release
from tests.helpers.prewarmed import run_module, run_python

REPO = Path(__file__).resolve().parent.parent
SEED_BUG = "0.5.13.post1"
FIXED = "0.5.14"
NEWEST = os.environ.get("SPECHARNESS_SGLANG_NEWEST", "0.5.23")
TOPK = 2  # draft_decode_topk of EngineConfig: tokens per request in draft decode (DECODE counts bs * topk)
T = 4  # num_draft_tokens of harness.engines.sglang.config.EngineConfig: tokens per request in draft-extend

pytestmark = pytest.mark.timeout(900)


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m harness.engines ARGS` in the repo root, in a process of its own forked from the prewarmed server."""
    return run_module("harness.engines", *args, cwd=REPO, timeout=timeout)


def _python(code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return run_python(textwrap.dedent(code), timeout=timeout)


# ----------------------------------------------------------------------------------------
# the three releases of the issue
# ----------------------------------------------------------------------------------------


@pytest.mark.engine
def test_seed_bug_release_fails_naming_the_field_branch_and_counts():
    installed_release(SEED_BUG)
    proc = _run("--engine", f"sglang=={SEED_BUG}")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    verdict = [ln for ln in out.splitlines() if ln.startswith("verdict:")]
    assert verdict and verdict[0].startswith("verdict: FAIL"), out[-2000:]
    # the message our own P1 gives for the seed bug: field, branch, expected bs*T vs got bs
    m = re.search(r"P1/I1 global_num_tokens_for_logprob_gpu: expected \[(\d+)\], got \[(\d+)\] \[layout=[^\]]*\], branch=attn_tp_gather, "
                  r"runner=multi_layer, step=0, [^\]]*bs=(\d+)\]", verdict[0])
    assert m, verdict[0]
    expected, got, bs = map(int, m.groups())
    assert (expected, got) == (bs * T, bs)
    # only the seed bug: every failing line is a multi-layer runner in the attn-TP-gather branch
    failing = [ln for ln in out.splitlines() if ln.startswith("FAIL ")]
    assert failing
    for ln in failing:
        assert ln.split()[1].startswith("multi_layer[") and ln.split()[2] == "attn_tp_gather", ln
    # both attn-TP-gather layouts (with and without DP attention) and every step show it
    assert {ln.split()[3] for ln in failing} == {"tp4-dense_tp1", "tp4-dp2-dense_tp1-dp_lm_head-a2a_deepep"}
    assert {ln.split()[1] for ln in failing} == {"multi_layer[0]", "multi_layer[1]", "multi_layer[2]"}
    # the single-layer runner and the other branches pass on the same release
    assert re.search(r"^ok +single_layer +attn_tp_gather", out, re.M)
    assert re.search(r"^ok +multi_layer\[0\] +mlp_tp_gather", out, re.M)
    # I2 (rows fed to lm_head), I3 (branch parity) and I6 (single vs multi) see it too
    summary = next(ln for ln in out.splitlines() if ln.startswith("failing (check, field, branch)"))
    for check in ("I1 global_num_tokens_for_logprob_gpu [attn_tp_gather]", "I2 global_num_tokens_for_logprob_gpu (capture) [attn_tp_gather]",
                  "I3 global_num_tokens_for_logprob [attn_tp_gather]", "I6 global_num_tokens_for_logprob [attn_tp_gather]"):
        assert check in summary, summary


@pytest.mark.engine
def test_fixed_release_passes_with_json():
    path = installed_release(FIXED)
    tag = sys.implementation.cache_tag  # the gate loaded the release once, writing the bytecode of what a check imports
    assert (path / f".bytecode-{tag}").is_file() and (path / "sglang" / "__pycache__" / f"__init__.{tag}.pyc").is_file()
    proc = _run("--engine", f"sglang=={FIXED}", "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    assert rep["ok"] and rep["version"] == FIXED and rep["summary"]["failures"] == 0
    lines = rep["lines"]
    # one line per (runner, branch, bucket): every branch, every runner (the graphed draft decode too), every step, checked on real records
    assert {ln["branch"] for ln in lines} == {"mlp_tp_gather", "attn_tp_gather", "neither"}
    assert {(ln["runner"], ln["step"]) for ln in lines} == {("multi_layer", 0), ("multi_layer", 1), ("multi_layer", 2), ("single_layer", 0),
                                                            ("draft_decode", 0), ("target_verify", 0)}
    assert all(ln["checked"] > 0 and ln["raw_bs"] and max(ln["raw_bs"]) == ln["bucket"] for ln in lines)
    attn = [ln for ln in lines if ln["branch"] == "attn_tp_gather"]
    # multiples of attn_tp_size; the verify's buckets are aligned by tokens (bs * T), so it keeps 1 and 2 too
    assert {ln["bucket"] for ln in attn if ln["layout"].startswith("tp4-dense_tp1") and ln["runner"] != "target_verify"} == {4, 8, 16}
    assert {ln["bucket"] for ln in attn if ln["layout"].startswith("tp4-dense_tp1") and ln["runner"] == "target_verify"} == {1, 2, 4, 8, 16}


@pytest.fixture(scope="module")
def newest_run(tmp_path_factory) -> dict:
    """One process for the newest release (importing sglang is most of a check's cost): the check as the command runs
    it (every representative layout), the same with --path gpu and with --path npu, a baseline written from the NPU run
    and read back, then bugs planted into the release's own code in memory, then a moved attribute."""
    target = installed_release(NEWEST)
    tmp = tmp_path_factory.mktemp("newest")
    proc = _python(f"""
        import json, sys
        from pathlib import Path
        from harness.engines.check import check_engine
        from harness.engines.install import deps_dir
        from harness.engines.sglang.errors import MissingEngineAttribute
        from harness.engines.sglang.loader import load
        from runners.parallel.layout import ParallelLayout
        from harness.engines.baseline import Baseline
        from harness.engines.options import FillPath, Selection
        eng = load(Path({str(target)!r}), deps_dir())
        ml = eng.modules["ml"]
        unmodified = check_engine(eng)
        out = {{"unmodified": unmodified.to_json()}}
        layouts = (ParallelLayout(4, 1, False, 1), ParallelLayout(4))

        # what --path gpu and --path npu run (every representative layout; the kernel on every replay for gpu)
        gpu = check_engine(eng, selection=Selection(frozenset({{FillPath.GPU}})))
        npu = check_engine(eng, selection=Selection(frozenset({{FillPath.NPU}})))
        out["gpu"], out["npu"] = gpu.to_json(), npu.to_json()
        out["exit"] = {{"gpu": gpu.exit_code(), "npu": npu.exit_code()}}
        # the baseline round trip: written from the NPU run, read back, the same findings known (exit 0), nothing stale;
        # the default run (both paths) against it: its NPU findings are the same ones, so known too
        base_file = Path({str(tmp)!r}) / "baseline.json"
        npu.as_baseline("sglang", "sglang " + eng.version).write(base_file)
        back = Baseline.load(base_file)
        out["baseline_file"] = base_file.read_text()
        out["roundtrip"] = {{"npu": npu.classify(back, str(base_file)).to_json(), "npu_exit": npu.exit_code(),
                            "default": unmodified.classify(back, str(base_file)).to_json(), "default_exit": unmodified.exit_code(),
                            "gpu": gpu.classify(back, str(base_file)).to_json(), "gpu_exit": gpu.exit_code()}}
        out["default_with_baseline"] = unmodified.to_json()

        # 1. the seed bug, in get_forward_batch: the attn-TP-gather branch bakes [bs]
        Runner = ml.MultiLayerEagleDraftExtendCudaGraphRunner
        real_gfb = Runner.get_forward_batch
        def seed_bug(self, bs):
            fb = real_gfb(self, bs)
            if self.require_attn_tp_gather and not self.require_mlp_tp_gather:
                self.buffers.global_num_tokens_for_logprob_gpu.fill_(bs)
            return fb
        Runner.get_forward_batch = seed_bug
        rep = check_engine(eng, layouts[:1], kernel_layouts=())
        out["seed"] = [f.message() for f in rep.failures() if f.check == "I1"][:1]  # beside the twin's own (path npu)
        out["seed_baseline"] = rep.classify(back, str(base_file)).to_json()  # the seed bug against the NPU baseline: new
        out["seed_exit"] = rep.exit_code()
        Runner.get_forward_batch = real_gfb

        # 2. prepare() leaves the padded seq_lens stale
        real_fill = ml.fill_draft_extend_prepare_buffers
        def stale_lanes(*args):
            seq_lens, raw_bs, bs = args[6], args[21], args[22]
            keep = seq_lens[raw_bs:bs].clone()
            real_fill(*args)
            seq_lens[raw_bs:bs] = keep + 7
        ml.fill_draft_extend_prepare_buffers = stale_lanes
        rep = check_engine(eng, layouts[1:], kernel_layouts=())
        out["stale"] = sorted({{(f.check, f.field) for f in rep.failures()}})
        ml.fill_draft_extend_prepare_buffers = real_fill

        # 3. the target verify bakes DP token counts where the branch has no gathered buffer (plain TP)
        DCG = sys.modules["sglang.srt.model_executor.runner.decode_cuda_graph_runner"].DecodeCudaGraphRunner
        real_counts = DCG._global_num_tokens_for_graph
        DCG._global_num_tokens_for_graph = lambda self, n: real_counts(self, n) or [n]
        rep = check_engine(eng, layouts[1:], kernel_layouts=())
        out["verify_counts"] = sorted({{(f.check, f.field, f.where["runner"], f.where.get("path", "")) for f in rep.failures()}})
        DCG._global_num_tokens_for_graph = real_counts

        # 4. a release whose runner reads something new off the worker
        SL = eng.modules["sl"].EAGLEDraftExtendCudaGraphRunner
        real_init = SL.__init__
        def moved(self, eagle_worker, *a, **k):
            eagle_worker.draft_extend_attn_backend_v3
            return real_init(self, eagle_worker, *a, **k)
        SL.__init__ = moved
        try:
            check_engine(eng, layouts[1:], kernel_layouts=())
            out["moved"] = None
        except MissingEngineAttribute as e:
            out["moved"] = str(e)
        print(json.dumps(out, default=str))
    """)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.engine
def test_newest_release_passes_on_the_gpu_path_and_fails_only_the_native_twins_token_tail(newest_run):
    """The Triton fill kernel (the GPU path) zeroes the padded token rows; its native twin (the NPU path)
    leaves them as the last, larger batch wrote them: the only failures, and each says path=npu."""
    rep = newest_run["unmodified"]
    assert not rep["ok"] and rep["version"] == NEWEST
    fails = [f for ln in rep["lines"] for f in ln["failures"]]
    assert fails
    # the per-step composite only: the one graph (multi_layer_1g) is built only off NPU, its prepare() fills with the kernel
    assert {(f["check"], f["where"]["runner"], f["where"].get("path")) for f in fails} == {
        (c, "multi_layer", "npu") for c in ("canonical", "pad value", "stale slot")}
    assert {ln["path"] for ln in rep["lines"] if not ln["ok"]} == {"npu"}
    assert {f["field"] for f in fails if f["check"] == "canonical"} == {"input_ids", "positions", "out_cache_loc"}
    assert {f["field"] for f in fails if f["check"] == "pad value"} == {"positions", "out_cache_loc"}  # index buffers only
    # out_cache_loc, the KV write of each padded token: after a larger batch it holds that batch's slots (stale slot, harmful at
    # any page size); before any, the buffer's torch.ones: slot 1, live at page size 1 and on the dummy page 0 at the NPU's 128
    slots = [f for f in fails if f["field"] == "out_cache_loc" and f["check"] != "canonical"]
    assert {(f["check"], f["where"].get("page_size")) for f in slots} == {("stale slot", None), ("pad value", 1)}
    assert {f["got"] for f in slots if f["check"] == "pad value"} == {1}
    assert all(f["got"] >= 135 for f in slots if f["check"] == "stale slot")  # the live batches' slots (lanes.FIRST_LIVE_SLOT on)
    # the report leads with a harmful write: its first failure is a stale slot
    assert rep["first_failure"]["check"] == "stale slot", rep["first_failure"]
    single = [ln for ln in rep["lines"] if ln["runner"] == "single_layer"]
    assert single and all(ln["ok"] for ln in single)
    # past the model call: what it cannot reach is said, as a skip, never as a pass
    assert any(why.startswith("I7 ") for why in rep["skipped"]), rep["skipped"]


@pytest.mark.engine
def test_newest_release_gpu_path_passes_and_npu_path_fails_naming_the_stale_slot_writes(newest_run):
    """--path gpu: the kernel on every replay of every layout, the one graph built, no twin: exit 0, and the NPU path said
    not checked. --path npu: the twin on every replay, no one graph: exit 1, led by the stale-slot KV writes."""
    gpu, npu = newest_run["gpu"], newest_run["npu"]
    assert newest_run["exit"] == {"gpu": 0, "npu": 1}
    assert gpu["ok"] and gpu["paths"].startswith("path: gpu") and "npu not checked: --path gpu" in gpu["paths"]
    assert {ln["path"] for ln in gpu["lines"]} == {"gpu", ""} and "multi_layer_1g" in {ln["runner"] for ln in gpu["lines"]}
    assert any(why.startswith("npu path") and "not checked: --path gpu" in why for why in gpu["skipped"]), gpu["skipped"]
    # every layout's per-step composite ran the kernel (not only KERNEL_LAYOUTS' first DP group)
    assert len({ln["layout"] for ln in gpu["lines"] if ln["runner"] == "multi_layer" and ln["path"] == "gpu"}) == 5
    assert not npu["ok"] and {ln["path"] for ln in npu["lines"]} == {"npu", ""}
    assert "multi_layer_1g" not in {ln["runner"] for ln in npu["lines"]}
    assert any(why.startswith("multi_layer_1g") and "--path npu" in why for why in npu["skipped"]), npu["skipped"]
    assert npu["first_failure"]["check"] == "stale slot" and npu["first_failure"]["field"] == "out_cache_loc"
    fails = [f for ln in npu["lines"] for f in ln["failures"]]
    assert {ln["runner"] for ln in npu["lines"] if not ln["ok"]} == {"multi_layer"}
    stale = [f for f in fails if f["check"] == "stale slot"]
    assert {f["where"]["branch"] for f in stale} == {"mlp_tp_gather", "attn_tp_gather", "neither"}, stale[:3]


@pytest.mark.engine
def test_baseline_round_trips_and_gates_on_new_findings_only(newest_run):
    """A baseline written from a run classifies that run's findings as known (exit 0, nothing stale), the default run's
    NPU findings too; a run that checks no NPU path leaves the NPU entries not checked (not stale); the seed bug planted
    into the same release is new (exit 1)."""
    rt = newest_run["roundtrip"]
    assert rt["npu"]["ok"] and rt["npu"]["new"] == 0 and rt["npu"]["known"] > 0 and not rt["npu"]["stale"], rt["npu"]
    assert rt["npu_exit"] == 0 and rt["default_exit"] == 0 and rt["gpu_exit"] == 0
    assert rt["default"]["known"] == rt["npu"]["known"] and not rt["default"]["stale"], rt["default"]
    assert rt["gpu"]["known"] == 0 and not rt["gpu"]["stale"] and len(rt["gpu"]["not_checked"]) == rt["npu"]["known"]
    # the file: stable identities (runner, step, branch, path, page size), no bucket, rank, iteration or lane
    doc = json.loads(newest_run["baseline_file"])
    assert doc["format"] == "specharness-engine-check-baseline/1" and doc["engine"] == "sglang"
    keys = {k for f in doc["findings"] for k in f}
    assert keys <= {"prop", "check", "field", "runner", "step", "branch", "path", "page_size"}, keys
    assert {"check": "stale slot", "field": "out_cache_loc", "prop": "P1", "runner": "multi_layer", "step": 0, "branch": "neither",
            "path": "npu"} in doc["findings"]
    # JSON marks each failure known or new
    marks = {f["baseline"] for ln in newest_run["default_with_baseline"]["lines"] for f in ln["failures"]}
    assert marks == {"known"}
    seed = newest_run["seed_baseline"]
    assert newest_run["seed_exit"] == 1 and not seed["ok"]
    assert {(f["check"], f["runner"], f["branch"]) for f in seed["new_findings"]} >= {("I1", "multi_layer", "attn_tp_gather")}, seed


@pytest.mark.engine
def test_newest_release_one_graph_composite_is_driven_beside_the_per_step_one(newest_run):
    """The one-graph composite (FA3's default) gets its own lines: every layout, every step, the per-step composite's buckets,
    the restore and served checks run (on step 0 / every step), and the logits it hands back but its worker never reads are said skipped."""
    rep = newest_run["unmodified"]
    one = [ln for ln in rep["lines"] if ln["runner"] == "multi_layer_1g"]
    per_step = {(ln["layout"], ln["step"], ln["bucket"]) for ln in rep["lines"] if ln["runner"] == "multi_layer"}
    assert {(ln["layout"], ln["step"], ln["bucket"]) for ln in one} == per_step and len({ln["layout"] for ln in one}) == 5
    assert all(ln["checked"] > 0 and ln["raw_bs"] for ln in one)
    # it fills with the kernel on every replay (built only off NPU): it passes, and the twin it never runs is said skipped
    assert all(ln["ok"] for ln in one), [f for ln in one for f in ln["failures"]][:3]
    assert any(why.startswith("multi_layer_1g: the logits replay(step) hands back") for why in rep["skipped"]), rep["skipped"]
    assert any(why.startswith("multi_layer_1g: prepare()'s native (NPU) fill twin: not run") for why in rep["skipped"]), rep["skipped"]


@pytest.mark.engine
def test_newest_release_draft_decode_runner_is_driven_on_every_layout_and_passes(newest_run):
    """SGLang's graphed draft decode (EAGLEDraftCudaGraphRunner) gets its own lines: every representative layout, every
    bucket its capture_bs lists, DECODE's width (topk tokens per request), and nothing said skipped for it."""
    rep = newest_run["unmodified"]
    dd = [ln for ln in rep["lines"] if ln["runner"] == "draft_decode"]
    assert {ln["layout"] for ln in dd} == {ln["layout"] for ln in rep["lines"] if ln["runner"] == "single_layer"}
    assert len({ln["layout"] for ln in dd}) == 5
    assert all(ln["ok"] and ln["checked"] > 0 and ln["raw_bs"] for ln in dd), [ln for ln in dd if not ln["ok"]][:1]
    assert {ln["tokens_per_bs"] for ln in dd} == {TOPK}
    assert {ln["bucket"] for ln in dd if ln["branch"] == "neither"} == {1, 2, 4, 8, 16}
    assert not any("draft_decode" in why for why in rep["skipped"]), rep["skipped"]


@pytest.mark.engine
def test_newest_release_target_verify_graphs_are_driven_on_every_layout_and_pass(newest_run):
    """The target's TARGET_VERIFY graphs get their own lines: every representative layout, every bucket, the verify's
    width (num_draft_tokens per request), buckets aligned by tokens (bs * T a multiple of attn_tp_size, so the
    attn-TP gather layouts keep 1 and 2, which the draft-extend runners drop), and nothing said skipped for them."""
    rep = newest_run["unmodified"]
    tv = [ln for ln in rep["lines"] if ln["runner"] == "target_verify"]
    assert len({ln["layout"] for ln in tv}) == 5
    assert all(ln["ok"] and ln["checked"] > 0 and ln["raw_bs"] for ln in tv), [ln for ln in tv if not ln["ok"]][:1]
    assert {ln["tokens_per_bs"] for ln in tv} == {4}
    assert {ln["bucket"] for ln in tv if ln["layout"].startswith("tp4-dense_tp1")} == {1, 2, 4, 8, 16}
    assert not any("target_verify" in why for why in rep["skipped"]), rep["skipped"]


# ----------------------------------------------------------------------------------------
# the check is not vacuous on the newest release, and a moved attribute is named
# ----------------------------------------------------------------------------------------


@pytest.mark.engine
def test_newest_release_planted_engine_bugs_are_caught_and_moves_are_named(newest_run):
    """Plant the seed bug, a stale padded lane and DP counts in the verify graph of a branch without a gathered buffer
    in the newest release's own code; then make its runner read an attribute our stand-ins lack, as a new release would."""
    out = newest_run
    assert out["seed"] and re.match(r"P1/I1 global_num_tokens_for_logprob_gpu: expected \[(\d+)\], got \[(\d+)\] .*branch=attn_tp_gather", out["seed"][0])
    assert ["padding", "padded seq_lens"] in out["stale"] and ["padding", "seq_lens_sum"] in out["stale"], out["stale"]
    assert out["moved"] and "eagle_worker.draft_extend_attn_backend_v3" in out["moved"], out["moved"]
    # the target verify's capture with DP token counts and a DP buffer in a branch without a gathered buffer
    assert {("padding", "global_num_tokens_cpu", "target_verify"), ("padding", "global_dp_buffer_len", "target_verify")} <= {
        tuple(f[:3]) for f in out["verify_counts"]}, out["verify_counts"]
    # beside the release's own native-twin failures (path npu), on target_verify lines only
    assert {f[2] for f in out["verify_counts"] if f[3] != "npu"} == {"target_verify"}, out["verify_counts"]


# ----------------------------------------------------------------------------------------
# the adapter's machinery, without any engine
# ----------------------------------------------------------------------------------------


def test_stub_modules_are_package_like_with_subclassable_classes():
    from harness.engines.sglang.stubs import StubFinder

    finder = StubFinder(("fake_thirdparty_pkg",))
    assert finder.find_spec("json") is None  # only the listed names
    assert finder.find_spec("fake_other") is None
    spec = finder.find_spec("fake_thirdparty_pkg.sub.mod")
    mod = importlib.util.module_from_spec(spec)
    assert mod.__path__ == []

    class Mine(mod.PretrainedConfig):  # capitalised attributes are real classes
        pass

    assert isinstance(Mine(1, x=2), mod.PretrainedConfig)

    class FromLower(mod.tqdm):  # so are lower-case ones (`from tqdm import tqdm`)
        pass

    def f():
        return 3

    assert mod.lru_cache(f) is f  # used as a decorator: the function is kept
    assert mod.model_serializer(mode="wrap")(f) is f  # a decorator factory too
    assert not mod.is_flash_attn_available()  # calls give falsy stand-ins
    assert list(mod.CONFIG_MAPPING.items()) == []


def test_strict_stand_ins_name_what_the_engine_read():
    from harness.engines.sglang.errors import MissingEngineAttribute
    from harness.engines.sglang.standins import Strict

    worker = Strict("eagle_worker", topk=1)
    assert worker.topk == 1
    assert getattr(worker, "hot_token_id", None) is None  # getattr with a default still works (an AttributeError)
    with pytest.raises(MissingEngineAttribute, match=r"eagle_worker\.speculative_num_steps.*harness/engines/sglang"):
        _ = worker.speculative_num_steps


def test_engine_spec_and_missing_install():
    assert EngineSpec.parse("sglang==0.5.14").version == "0.5.14"
    assert EngineSpec.parse("sglang").version is None
    for bad in ("trtllm==0.1", "sglang==", "sglang==;rm"):
        with pytest.raises(ValueError):
            EngineSpec.parse(bad)
    rc, err = _main_in_process("--engine", "sglang==0.0.0.dev0", "--target", str(REPO / ".engines" / "nowhere"))
    assert rc == 2 and "no sglang package under" in err


def test_release_selection_all_range_and_list():
    from harness.engines.releases import FIRST_RELEASE, select

    listed = ["0.5.6.post2", FIRST_RELEASE, "0.5.8", "0.5.10", "0.5.10.post1", "0.5.11", "0.5.23"]
    assert select("all", lambda: listed) == listed[1:]  # from the first release with the multi-layer runner
    assert select("0.5.10..0.5.11", lambda: listed) == ["0.5.10", "0.5.10.post1", "0.5.11"]
    assert select("0.5.11..", lambda: listed) == ["0.5.11", "0.5.23"]
    assert select("0.5.14, 0.5.23", lambda: pytest.fail("a list needs no index")) == ["0.5.14", "0.5.23"]
    with pytest.raises(ValueError):
        select("0.6.0..0.7.0", lambda: listed)


def test_releases_refuses_a_pinned_engine():
    rc, err = _main_in_process("--engine", "sglang==0.5.23", "--releases", "all")
    assert rc == 2 and "--releases picks the versions" in err


def _main_in_process(*args: str) -> tuple[int, str]:
    """The command's own entry point, for paths that stop before loading an engine (loading one swaps globals process-wide)."""
    import argparse
    import contextlib
    import io

    from harness.engines.command import add_arguments, main

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(parser.parse_args(list(args)))
    assert "sglang" not in sys.modules, "an error path loaded an engine into the test process"
    return rc, err.getvalue()
