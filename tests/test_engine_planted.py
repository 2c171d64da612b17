"""Bugs planted by hand into a copy of an installed SGLang release are caught, and on the right runner and fill path.

Each test links the installed release into a temp dir (files symlinked, the one planted file
copied and edited: one line), runs engine-check on the copy in its own process, and compares
the failures with the unmodified release's under the same layouts. NEWEST is the release the
planted lines were read from; a release without the line skips, naming it. The release is
installed as tests/test_engine_check.py installs it (cached, under a file lock), so whether
these run never depends on which test happened to install it first; a machine where pip
cannot install it skips with pip's reason.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from engine_releases import installed_release

REPO = Path(__file__).resolve().parent.parent
NEWEST = os.environ.get("SPECHARNESS_SGLANG_NEWEST", "0.5.23")
KERNEL = "sglang/kernels/ops/speculative/multi_layer_eagle.py"
SINGLE = "sglang/srt/speculative/eagle_draft_extend_cuda_graph_runner.py"
ATTN_TP = "ParallelLayout(4, 1, False, 1)"  # attn-TP gather: gathered buffers, one DP rank
PLAIN = "ParallelLayout(4)"  # neither branch

pytestmark = pytest.mark.timeout(900)


def _plant(src: Path, dst: Path, rel: str, old: str, new: str) -> Path:
    """dst: src's files as symlinks, except `rel`, a real copy with `old` replaced by `new` (exactly once)."""
    shutil.copytree(src, dst, symlinks=True, copy_function=os.symlink)
    text = (src / rel).read_text()
    if text.count(old) != 1:
        pytest.skip(f"sglang {NEWEST}: {rel} does not have the line {old.strip()!r} exactly once")
    (dst / rel).unlink()
    (dst / rel).write_text(text.replace(old, new))
    return dst


def _failures(target: Path, layouts: str, kernel_layouts: str) -> list[dict]:
    """(check, field, runner, step, path) of every failure engine-check finds in the release at target."""
    code = f"""
        import json
        from pathlib import Path
        from harness.engines.check import check_engine
        from harness.engines.install import deps_dir
        from harness.engines.sglang.loader import load
        from runners.parallel.layout import ParallelLayout
        eng = load(Path({str(target)!r}), deps_dir())
        rep = check_engine(eng, tuple([{layouts}]), kernel_layouts=tuple([{kernel_layouts}]))
        print(json.dumps([dict(check=f.check, field=f.field, runner=f.where.get("runner"), step=f.where.get("step"),
                               path=f.where.get("path", "")) for f in rep.failures()]))
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _kinds(fails: list[dict]) -> set[tuple]:
    return {(f["check"], f["field"], f["runner"], f["path"]) for f in fails}


@pytest.fixture(scope="module")
def newest() -> Path:
    return installed_release(NEWEST)


@pytest.fixture(scope="module")
def baseline(newest: Path) -> dict[str, set[tuple]]:
    """The unmodified release under the layouts each test uses: what a plant must add to."""
    return {"kernel": _kinds(_failures(newest, f"{ATTN_TP}, {PLAIN}", f"{ATTN_TP}, {PLAIN}")),
            "native": _kinds(_failures(newest, PLAIN, ""))}


def test_unmodified_newest_release_fails_only_on_the_native_twins_token_tail(baseline):
    # The Triton kernel zeroes the padded token rows; its native twin (the NPU path) copies the real rows
    # and leaves the rest as the last, larger batch wrote it. Everything on the kernel's path holds.
    for kinds in baseline.values():
        assert kinds, "the native twin's stale token tail was not seen"
        assert {(c, r, p) for c, _f, r, p in kinds} == {("canonical", "multi_layer", "npu")}, kinds
        assert {f for _c, f, _r, _p in kinds} <= {"input_ids", "positions", "out_cache_loc"}, kinds


def test_bug_in_the_triton_fill_kernel_is_caught_on_the_gpu_path(newest, baseline, tmp_path):
    # the kernel stops resetting padded seq_lens: it stores the real rows only
    target = _plant(newest, tmp_path / "sglang", KERNEL, "tl.store(seq_lens_ptr + i, sl.to(tl.int32))\n",
                    "tl.store(seq_lens_ptr + i, sl.to(tl.int32), mask=is_real)\n")
    new = _kinds(_failures(target, f"{ATTN_TP}, {PLAIN}", f"{ATTN_TP}, {PLAIN}")) - baseline["kernel"]
    assert ("canonical", "seq_lens", "multi_layer", "gpu") in new, new
    assert {r for _c, _f, r, _p in new} == {"multi_layer"}, new
    assert not any(p == "npu" for *_, p in new), new  # the twin, run beside it on the same inputs, is not blamed


def test_bug_in_the_native_fill_twin_is_caught_on_the_npu_path(newest, baseline, tmp_path):
    # the twin stops resetting seq_lens[:bs] to the fill value
    target = _plant(newest, tmp_path / "sglang", KERNEL, "    seq_lens[:bs].fill_(seq_len_fill_value)\n", "    pass\n")
    new = _kinds(_failures(target, PLAIN, "")) - baseline["native"]
    assert ("canonical", "seq_lens", "multi_layer", "npu") in new, new
    assert {r for _c, _f, r, _p in new} == {"multi_layer"}, new
    assert not any(p == "gpu" for *_, p in new), new


def test_single_layer_runner_without_req_pool_indices_zero_is_caught_on_its_own_lines(newest, tmp_path):
    target = _plant(newest, tmp_path / "sglang", SINGLE, "            buffers.req_pool_indices.zero_()\n", "            pass\n")
    fails = _failures(target, PLAIN, "")
    single = {(f["check"], f["field"]) for f in fails if f["runner"] == "single_layer"}
    assert single == {("canonical", "req_pool_indices")}, single


def test_single_layer_replay_fill_bug_is_attributed_to_the_single_layer_runner(newest, tmp_path):
    # the single-layer runner's replay fill says bs * T where its capture (pruned logits) baked bs
    target = _plant(newest, tmp_path / "sglang", SINGLE, "            buffers.global_num_tokens_for_logprob_gpu.fill_(bs)\n",
                    "            buffers.global_num_tokens_for_logprob_gpu.fill_(bs * self.captured_req_width)\n")
    fails = _failures(target, ATTN_TP, "")
    lp = [f for f in fails if "logprob" in f["field"]]
    assert lp and {f["runner"] for f in lp} == {"single_layer"}, lp
    assert "I1" in {f["check"] for f in lp}, lp
