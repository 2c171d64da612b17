"""Bugs planted by hand into a copy of an installed SGLang release are caught, and on the right runner and fill path.

Each test links the installed release into a temp dir (files symlinked, the one planted file
copied and edited: one line), runs engine-check on the copy in its own process, and looks at
the failures the plant adds to the unmodified release's. What the unmodified releases give is
asserted by tests/test_engine_check.py over every representative layout (a superset of the
layouts here, with the interpreted kernels and the step body driven in the same places):
FIXED passes, NEWEST fails only on the native twin's stale token tail (NATIVE_TAIL below).
NEWEST / FIXED are the releases the planted lines were read from; a release without the line
skips, naming it. The releases are installed as tests/test_engine_check.py installs them
(cached, under a file lock), so whether these run never depends on which test happened to
install one first; a machine where pip cannot install one skips with pip's reason.
"""
from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from tests.helpers.engine_releases import installed_release
from tests.helpers.planted import planted_copy
from tests.helpers.prewarmed import run_module, run_python

REPO = Path(__file__).resolve().parent.parent
NEWEST = os.environ.get("SPECHARNESS_SGLANG_NEWEST", "0.5.23")
FIXED = "0.5.14"  # the first release without the seed bug; its step windows grow, and its step body advances the draft chain
KERNEL = "sglang/kernels/ops/speculative/multi_layer_eagle.py"
SINGLE = "sglang/srt/speculative/eagle_draft_extend_cuda_graph_runner.py"
MULTI = "sglang/srt/speculative/multi_layer_eagle_draft_extend_cuda_graph_runner.py"
DRAFT = "sglang/srt/speculative/eagle_draft_cuda_graph_runner.py"  # the graphed draft decode (EAGLEDraftCudaGraphRunner)
CHAIN = "sglang/srt/speculative/triton_ops/multi_layer_eagle.py"  # FIXED's assign_new_state kernel: the in-graph draft chain
ATTN_TP = "ParallelLayout(4, 1, False, 1)"  # attn-TP gather: gathered buffers, one DP rank
PLAIN = "ParallelLayout(4)"  # neither branch

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def _plant(src: Path, dst: Path, rel: str, old: str, new: str) -> Path:
    """dst: a view of src through symlinks (tests/helpers/planted.py), except `rel`, a real copy with `old` replaced by `new` (exactly once)."""
    text = (src / rel).read_text()
    if text.count(old) != 1:
        pytest.skip(f"sglang at {src.name}: {rel} does not have the line {old.strip()!r} exactly once")
    return planted_copy(src, dst, {rel: text.replace(old, new)})


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
    proc = run_python(textwrap.dedent(code), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _kinds(fails: list[dict]) -> set[tuple]:
    return {(f["check"], f["field"], f["runner"], f["path"]) for f in fails}


ONE_GRAPH = "multi_layer_1g"  # the one-graph composite's lines (0.5.16 on): it shares prepare()'s Triton kernel with the per-step one
# (off NPU, the only place the worker builds it), never the native twin (FillObserver.kernel_alone)
COMPOSITES = {"multi_layer", ONE_GRAPH}
# the unmodified NEWEST's only failures (tests/test_engine_check.py): its native fill twin leaves padded token rows stale,
# so they depend on the history and, for the index buffers, point at a larger batch's slots and positions
NATIVE_TAIL = ({("canonical", f, "multi_layer", "npu") for f in ("input_ids", "positions", "out_cache_loc")}
               | {("pad value", f, "multi_layer", "npu") for f in ("positions", "out_cache_loc")}
               | {("stale slot", "out_cache_loc", "multi_layer", "npu")})


def _added(fails: list[dict]) -> set[tuple]:
    return _kinds(fails) - NATIVE_TAIL


@pytest.fixture(scope="module")
def newest() -> Path:
    return installed_release(NEWEST)


@pytest.fixture(scope="module")
def fixed() -> Path:
    return installed_release(FIXED)


# ---- replay fills ----


def test_bug_in_the_triton_fill_kernel_is_caught_on_the_gpu_path(newest, tmp_path):
    # the kernel stops resetting padded seq_lens: it stores the real rows only
    target = _plant(newest, tmp_path / "sglang", KERNEL, "tl.store(seq_lens_ptr + i, sl.to(tl.int32))\n",
                    "tl.store(seq_lens_ptr + i, sl.to(tl.int32), mask=is_real)\n")
    new = _added(_failures(target, PLAIN, PLAIN))
    assert {("canonical", "seq_lens", r, "gpu") for r in COMPOSITES} <= new, new
    assert {r for _c, _f, r, _p in new} == COMPOSITES, new  # both composites fill through it
    assert not any(p == "npu" for *_, p in new), new  # the twin, run beside it on the same inputs, is not blamed


def test_triton_fill_kernel_padding_with_a_live_slot_is_caught_by_the_pad_value(newest, tmp_path):
    # the kernel pads out_cache_loc with slot 1 instead of the padding slot 0: the same value after any history, so
    # history independence passes it; every padded token of the multi-layer steps would write its KV into slot 1
    target = _plant(newest, tmp_path / "sglang", KERNEL,
                    "        tok = tl.load(src_out_cache_loc_ptr + tok_offs, mask=copy_mask, other=0).to(\n",
                    "        tok = tl.load(src_out_cache_loc_ptr + tok_offs, mask=copy_mask, other=1).to(\n")
    new = _added(_failures(target, PLAIN, PLAIN))
    assert new == {("pad value", "out_cache_loc", r, "gpu") for r in COMPOSITES}, new


def test_bug_in_the_native_fill_twin_is_caught_on_the_npu_path(newest, tmp_path):
    # the twin stops resetting seq_lens[:bs] to the fill value
    target = _plant(newest, tmp_path / "sglang", KERNEL, "    seq_lens[:bs].fill_(seq_len_fill_value)\n", "    pass\n")
    new = _added(_failures(target, PLAIN, ""))
    assert ("canonical", "seq_lens", "multi_layer", "npu") in new, new
    assert {r for _c, _f, r, _p in new} == {"multi_layer"}, new  # the one graph never fills through the twin
    assert not any(p == "gpu" for *_, p in new), new


def test_single_layer_runner_without_req_pool_indices_zero_is_caught_on_its_own_lines(newest, tmp_path):
    target = _plant(newest, tmp_path / "sglang", SINGLE, "            buffers.req_pool_indices.zero_()\n", "            pass\n")
    fails = _failures(target, PLAIN, "")
    single = {(f["check"], f["field"]) for f in fails if f["runner"] == "single_layer"}
    assert single == {("canonical", "req_pool_indices"), ("pad value", "req_pool_indices")}, single


def test_single_layer_replay_fill_bug_is_attributed_to_the_single_layer_runner(newest, tmp_path):
    # the single-layer runner's replay fill says bs * T where its capture (pruned logits) baked bs
    target = _plant(newest, tmp_path / "sglang", SINGLE, "            buffers.global_num_tokens_for_logprob_gpu.fill_(bs)\n",
                    "            buffers.global_num_tokens_for_logprob_gpu.fill_(bs * self.captured_req_width)\n")
    fails = _failures(target, ATTN_TP, "")
    lp = [f for f in fails if "logprob" in f["field"]]
    assert lp and {f["runner"] for f in lp} == {"single_layer"}, lp
    assert "I1" in {f["check"] for f in lp}, lp


# ---- past the model call (harness/engines/after_model.py) ----


def test_select_index_without_the_step_is_caught_on_the_later_steps(fixed, tmp_path):
    # the step body's select_index forgets that each step's window grew by the tokens drafted so far
    target = _plant(fixed, tmp_path / "sglang", MULTI, "                + buffers.num_correct_drafts[:bs]\n                + self.step\n",
                    "                + buffers.num_correct_drafts[:bs]\n")
    fails = _failures(target, PLAIN, PLAIN)
    assert {(f["check"], f["field"], f["runner"]) for f in fails} == {("select", "topk_index", "multi_layer")}, _kinds(fails)
    assert {f["step"] for f in fails} == {1, 2}  # step 0 has grown by nothing: the bug is invisible there


def test_draft_chain_write_bug_is_caught_on_the_next_step(fixed, tmp_path):
    # the chain kernel writes the drafted token one row past the request's last accepted row of the next step's window
    target = _plant(fixed, tmp_path / "sglang", CHAIN, "        input_ids_ptr + new_start + old_extend_len - padding_len,\n",
                    "        input_ids_ptr + new_start + old_extend_len - padding_len + 1,\n")
    fails = _failures(target, PLAIN, PLAIN)
    assert ("chain", "input_ids", "multi_layer") in {(f["check"], f["field"], f["runner"]) for f in fails}, _kinds(fails)
    assert {f["runner"] for f in fails} == {"multi_layer"} and {f["step"] for f in fails} == {1, 2}, _kinds(fails)


def test_worker_rotation_writing_the_draft_at_the_window_end_is_caught_on_the_later_steps(newest, tmp_path):
    # the worker's rotate_input_ids (one window for all steps) writes the drafted token at the window's last row instead
    # of the request's last accepted row (select_index): step 1 and 2 read a rejected draft where the chain should be
    target = _plant(newest, tmp_path / "sglang", KERNEL, "            last_pos_ptr = input_ids_ptr + tl.load(select_index_ptr + pid)\n",
                    "            last_pos_ptr = input_ids_ptr + start_loc + seq_len - 1\n")
    fails = [f for f in _failures(target, PLAIN, PLAIN) if (f["check"], f["field"], f["runner"], f["path"]) not in NATIVE_TAIL]
    # the one graph rotates with the same kernel, inside the graph
    assert {(f["check"], f["field"], f["runner"]) for f in fails} == {("chain", "input_ids", r) for r in COMPOSITES}, _kinds(fails)
    assert {f["step"] for f in fails} == {1, 2}  # step 0 reads the fill's window: nothing rotated yet


def test_select_index_bug_in_the_triton_fill_kernel_is_caught_after_the_model_call(newest, tmp_path):
    # the kernel's select_index forgets the accepted drafts: the body takes the window's first row's logits
    target = _plant(newest, tmp_path / "sglang", KERNEL, "        si = i.to(tl.int64) * num_tokens_per_bs + num_front_tokens + ncd\n",
                    "        si = i.to(tl.int64) * num_tokens_per_bs + num_front_tokens\n")
    new = _added(_failures(target, ATTN_TP, ATTN_TP))
    assert {r for _c, _f, r, _p in new} == COMPOSITES, new
    assert {(c, f, r, p) for r in COMPOSITES for c, f, p in (("lanes", "select_index", "gpu"), ("select", "topk_index", ""),
                                                             ("I6", "selected logits", ""))} <= new, new
    assert not any(p == "npu" for *_, p in new), new


def test_select_index_bug_in_the_native_fill_twin_is_caught_on_the_npu_path(newest, tmp_path):
    target = _plant(newest, tmp_path / "sglang", KERNEL, "    select_index[:bs] += num_correct_drafts[:bs].to(torch.int64)\n", "    pass\n")
    new = _added(_failures(target, PLAIN, ""))
    assert new == {("lanes", "select_index", "multi_layer", "npu")}, new


def test_single_layer_select_index_bug_is_caught_and_attributed_to_it_though_it_prunes(newest, tmp_path):
    # the single-layer runner copies the row before each request's last accepted one into its select_index: its
    # logits processor prunes to those rows. I6 on the selected logits puts it on the single-layer runner.
    target = _plant(newest, tmp_path / "sglang", SINGLE, "        copy_srcs.append(select_index)\n", "        copy_srcs.append(select_index - 1)\n")
    new = _added(_failures(target, PLAIN, PLAIN))
    assert {r for _c, _f, r, _p in new} == {"single_layer"}, new
    assert {("lanes", "select_index", "single_layer", ""), ("select", "returned logits", "single_layer", ""),
            ("I6", "selected logits", "single_layer", "")} <= new, new


# ---- the graphed draft decode ----


def test_draft_decode_replay_fill_without_the_padded_seq_lens_is_caught_on_its_own_lines(newest, tmp_path):
    # the draft-decode runner's replay fill stops resetting seq_lens when it pads: padded lanes keep a larger batch's lengths
    target = _plant(newest, tmp_path / "sglang", DRAFT, "            buffers.seq_lens.fill_(self.seq_len_fill_value)\n", "            pass\n")
    new = _added(_failures(target, PLAIN, ""))
    assert {r for _c, _f, r, _p in new} == {"draft_decode"}, new
    assert {("padding", "padded seq_lens", "draft_decode", ""), ("canonical", "seq_lens", "draft_decode", "")} <= new, new


def test_draft_decode_replay_fill_counting_requests_not_tokens_is_caught_on_its_own_lines(newest, tmp_path):
    # the replay fill gathers bs (requests) where DECODE carries bs * topk tokens: capture baked bs * topk
    target = _plant(newest, tmp_path / "sglang", DRAFT, "            buffers.global_num_tokens_gpu.fill_(bs * self.captured_req_width)\n",
                    "            buffers.global_num_tokens_gpu.fill_(bs)\n")
    new = _added(_failures(target, ATTN_TP, ""))
    assert {r for _c, _f, r, _p in new} == {"draft_decode"}, new
    assert {("fill", "global_num_tokens_gpu (replay fill)", "draft_decode", ""), ("I1", "global_num_tokens_gpu", "draft_decode", "")} <= new, new


# ---- the one-graph composite (every step and the chain rotation in one graph per bucket) ----


def _one_graph_only(target: Path) -> list[dict]:
    """The plant's failures beyond the release's own; all of them on the one-graph composite's lines."""
    fails = [f for f in _failures(target, PLAIN, PLAIN) if (f["check"], f["field"], f["runner"], f["path"]) not in NATIVE_TAIL]
    assert {f["runner"] for f in fails} == {ONE_GRAPH}, _kinds(fails)
    return fails


def test_one_graph_capture_without_the_input_ids_restore_is_caught_by_the_restore_check(newest, tmp_path):
    # the composite drops the restore of input_ids after the capture's warm-up, which rotated them
    target = _plant(newest, tmp_path / "sglang", MULTI, "        buffers.input_ids.copy_(input_ids_orig)\n", "        pass\n")
    fails = _one_graph_only(target)
    assert {(f["check"], f["field"], f["step"]) for f in fails} == {("restore", "input_ids", 0)}, _kinds(fails)


def test_one_graph_skipping_the_rotation_before_the_last_step_is_caught_on_that_step(newest, tmp_path):
    # the in-graph rotation runs between steps 0 and 1 only: the last step drafts from step 1's window
    target = _plant(newest, tmp_path / "sglang", MULTI, "                if i < n - 1:\n", "                if i < n - 2:\n")
    fails = _one_graph_only(target)
    assert {(f["check"], f["field"], f["step"]) for f in fails} == {("chain", "input_ids", 2)}, _kinds(fails)


def test_one_graph_serving_another_steps_top_k_is_caught_on_the_steps_served(newest, tmp_path):
    # the replay's cache pairs each step with the outputs in reverse: steps 0 and 2 are served each other's top-k
    target = _plant(newest, tmp_path / "sglang", MULTI, "            for r, out in zip(non_null, outs):\n",
                    "            for r, out in zip(non_null, outs[::-1]):\n")
    fails = _one_graph_only(target)
    assert {(f["check"], f["field"]) for f in fails} == {("served", "topk_index")}, _kinds(fails)
    assert {f["step"] for f in fails} == {0, 2}  # step 1 is its own mirror


def test_one_graph_serving_the_padded_top_k_is_caught_as_padding(newest, tmp_path):
    # the cache keeps the bucket's rows: the worker would concatenate the padded requests' drafts with the real ones
    target = _plant(newest, tmp_path / "sglang", MULTI, "                    out.topk_index[:raw_bs],\n",
                    "                    out.topk_index[: self.bs],\n")
    fails = _one_graph_only(target)
    assert {(f["check"], f["field"]) for f in fails} == {("padding", "served top-k rows")}, _kinds(fails)
    assert {f["step"] for f in fails} == {0, 1, 2}


def test_one_graph_flag_off_builds_the_per_step_composite_only(newest):
    # SGLANG_ENABLE_SINGLE_CG_DRAFT off: the worker builds the per-step composite whatever the backend answers
    code = f"""
        import json, os
        os.environ["SGLANG_ENABLE_SINGLE_CG_DRAFT"] = "0"
        from pathlib import Path
        from harness.engines.check import check_engine
        from harness.engines.install import deps_dir
        from harness.engines.sglang.loader import load
        from runners.parallel.layout import ParallelLayout
        rep = check_engine(load(Path({str(newest)!r}), deps_dir()), (ParallelLayout(4),), kernel_layouts=())
        print(json.dumps({{"runners": sorted({{ln.runner for ln in rep.lines}}), "skipped": rep.skipped}}))
    """
    proc = run_python(textwrap.dedent(code), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "multi_layer" in out["runners"] and ONE_GRAPH not in out["runners"], out["runners"]
    assert any(why.startswith(f"{ONE_GRAPH}: not built") for why in out["skipped"]), out["skipped"]


# ---- a bug never costs the verdict: the command's exit status and its one JSON document ----

# The unmodified NEWEST's NPU-path finding identities, as a baseline names them, written by hand from NATIVE_TAIL and the
# page sizes it is checked at (tests/test_engine_check.py holds the unmodified release to them): every branch's per-step
# composite, step 0, path npu; out_cache_loc's pad value at page size 1 only (slot 1 is on the dummy page at 128).
NPU_BASELINE = {"format": "specharness-engine-check-baseline/1", "engine": "sglang", "findings": [
    {"prop": "P1", "check": check, "field": field, "runner": "multi_layer", "step": 0, "branch": branch, "path": "npu",
     **({"page_size": 1} if (check, field) == ("pad value", "out_cache_loc") else {})}
    for branch in ("mlp_tp_gather", "attn_tp_gather", "neither")
    for check, field in (("canonical", "input_ids"), ("canonical", "positions"), ("canonical", "out_cache_loc"),
                         ("pad value", "positions"), ("pad value", "out_cache_loc"), ("stale slot", "out_cache_loc"))]}


def _cli(target: Path, *args: str) -> tuple[int, dict, str]:
    """`harness engine-check --engine sglang --target TARGET --json ARGS`: its exit status, its one JSON document (the whole of
    stdout: a second document or a stray line would not parse), its stderr."""
    proc = run_module("harness.engines", "--engine", "sglang", "--target", str(target), "--json", *args, timeout=600)
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"exit {proc.returncode}, stdout is not one JSON document:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc.returncode, doc, proc.stderr


def test_dp_groups_disagreeing_on_the_bucket_is_a_finding_not_an_adapter_error(newest, tmp_path):
    # prepare() pads each DP group to its own batch, not the largest group's: in the MLP-TP branch the groups launch different
    # buckets in one iteration. The DP gather used to raise an adapter error there and the run ended exit 2, its findings lost.
    target = _plant(newest, tmp_path / "sglang", MULTI, "max_batch_size = max(forward_batch.original_global_num_tokens_cpu)",
                    "max_batch_size = forward_batch.batch_size")
    baseline = tmp_path / "npu-baseline.json"
    baseline.write_text(json.dumps(NPU_BASELINE))
    rc, doc, err = _cli(target, "--path", "npu", "--runner", "multi_layer", "--baseline", str(baseline))
    assert rc == 1, err[-3000:]
    fails = [(f["check"], f["field"], f["where"]["branch"], f["baseline"]) for ln in doc["lines"] for f in ln["failures"]]
    new = {f[:3] for f in fails if f[3] == "new"}
    assert ("dp-gather", "DP groups launching the bucket", "mlp_tp_gather") in new, new
    assert ("padding", "bs >= raw_bs", "mlp_tp_gather") in new, new
    assert {f[2] for f in fails if f[3] == "new"} == {"mlp_tp_gather"}  # only the branch whose groups pad together
    # the release's own NPU findings are still found, every one known
    assert {(c, fl) for c, fl, _b, mark in fails if mark == "known"} == {(f["check"], f["field"]) for f in NPU_BASELINE["findings"]}
    assert doc["baseline"]["new"] > 0 and not doc["baseline"]["ok"] and doc["selected"] == {"paths": ["npu"], "runners": ["multi_layer"]}
    # the selection: the per-step composite's lines only, the rest said not checked
    assert {(ln["runner"], ln["path"]) for ln in doc["lines"]} == {("multi_layer", "npu")}
    assert {why.split(":")[0] for why in doc["skipped"] if "not checked (this run selected --runner multi_layer)" in why} == {
        "multi_layer_1g", "single_layer", "draft_decode", "target_verify"}
    assert not [f for ln in doc["lines"] for f in ln["failures"] if f["check"] in ("raised", "crashed")]


def test_kernel_writing_past_its_buffer_and_a_process_killing_bug_are_findings(newest, tmp_path):
    # two plants: the Triton fill kernel stores each request's seq_len max_bs rows past it (past the end of seq_lens: under
    # the interpreter, unguarded, a heap write, `malloc(): smallbin double linked list corrupted` and an abort); the
    # single-layer replay fill reads address 0 (a segfault, which no bounds check sees)
    kernel = (newest / KERNEL).read_text()
    old = "        tl.store(seq_lens_ptr + i, sl.to(tl.int32))\n"
    if kernel.count(old) != 1:
        pytest.skip(f"sglang at {newest.name}: {KERNEL} does not have the line {old.strip()!r} exactly once")
    target = planted_copy(newest, tmp_path / "sglang", {
        KERNEL: kernel.replace(old, "        tl.store(seq_lens_ptr + i + max_bs, sl.to(tl.int32))\n"),
        SINGLE: (newest / SINGLE).read_text().replace("            buffers.req_pool_indices.zero_()\n", "            __import__('ctypes').string_at(0)\n", 1)})
    rc, doc, err = _cli(target, "--path", "gpu", "--runner", "multi_layer", "--runner", "single_layer")
    assert rc == 1, err[-3000:]
    fails = [f for ln in doc["lines"] for f in ln["failures"]]
    # the kernel's out-of-bounds stores are masked off and reported, once per replay that launched it, naming kernel and argument
    oob = [f for f in fails if f["check"] == "out of bounds"]
    assert oob and {(f["field"], f["where"]["runner"], f["where"]["kernel"]) for f in oob} == {
        ("replay_multi_layer (prepare, every step's replay)", "multi_layer", "fill_draft_extend_prepare_buffers_kernel")}, fails[:3]
    assert all("at bytes [64, 68) of argument `seq_lens_ptr" in f["got"] and "masked off" in f["got"] for f in oob), oob[0]
    # the kernel ran on without those stores, and what they did not write is caught too: no real seq_lens
    assert ("lanes", "seq_lens") in {(f["check"], f["field"]) for f in fails if f["where"]["runner"] == "multi_layer"}
    crashed = [f for f in fails if f["check"] == "crashed"]
    assert {(f["field"], f["where"]["runner"]) for f in crashed} == {("replay_single_layer", "single_layer")}, crashed[:2]
    assert sum(f["got"].startswith("the check process died (signal SIGSEGV)") for f in crashed) == 1
    assert "the check process died (signal SIGSEGV) in replay_single_layer" in err
    assert not [f for f in fails if f["check"] == "raised"]
    assert doc["first_failure"]["check"] == "crashed"  # the report leads with the worst
