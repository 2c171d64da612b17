"""SGLang's speculative graph runners beyond EAGLE's under engine-check: Frozen-KV MTP, UNO, the compact ragged verify, DFlash.

Three layers, cheapest first. Hand-worked values for the adapters' own rules (no engine). One
check of the newest release with the four runners named (module-scoped: every assertion on it reads
the same run), and one of 0.5.16, the first release with the ragged verify graphs, before the live
layout was staged into the captured one. Then one-line bugs planted by hand into two copies of the
newest release (files symlinked, the planted file copied and edited), four plants per copy, each in
the code of one runner, so that each copy costs one check and each plant is asserted on its own
runner's lines: every runner has two plants caught, and none of them touches another runner's
verdict. The releases come from tests/helpers/engine_releases.py (installed already, or with
SPECHARNESS_ENGINE_TESTS=1).
"""
from __future__ import annotations

import json
import os
import textwrap
import types
from pathlib import Path

import pytest

from harness.engines.lanes import LiveBatch
from harness.engines.report import Line
from harness.engines.sglang import dflash_verify, frozen_kv_mtp, ragged_verify, uno
from harness.engines.sglang.other_runners import OTHER_RUNNERS
from runners.parallel.layout import Branch, ParallelLayout
from tests.helpers.engine_releases import installed_release
from tests.helpers.planted import planted_copy
from tests.helpers.prewarmed import run_python
from tests.helpers.shared import computed_once

NEWEST = os.environ.get("SPECHARNESS_SGLANG_NEWEST", "0.5.23")
FIRST_RAGGED = "0.5.16"  # ragged_verify.py's first release: no _stage_ragged_verify_layout yet (0.5.17 added it)
KINDS = [r.kind for r in OTHER_RUNNERS]
MLP_TP = ParallelLayout(4, 2, True)
ATTN_TP = ParallelLayout(4, 1, False, 1)

pytestmark = pytest.mark.timeout(900)


# ---- the adapters' own rules, hand-worked ----


def _live(raw: int, it: int = 0) -> LiveBatch:
    return LiveBatch(raw, [raw], [7, 9, 12][:raw], [1, 2, 3][:raw], [1, 2, 3][:raw], it)


def test_frozen_batch_is_expanded_per_topk_with_the_last_written_position():
    ex = frozen_kv_mtp.expanded(_live(2), 2)
    assert (ex.raw_bs, ex.seq_lens, ex.req_pool_indices, ex.dp_batch_sizes) == (4, [7, 7, 9, 9], [1, 1, 2, 2], [4])
    assert ex.tokens(1) == {"positions": [6, 6, 8, 8]}  # seq_len - 1 per row: the frozen draft's rope position


def test_a_padded_frozen_request_passes_the_fill_value_check_only_if_all_its_rows_hold_it():
    # 1 real request, bucket 3, topk 2: rows [2, 6) are the padded requests 1 and 2; request 2's second row is stale
    assert frozen_kv_mtp.padded_request_seq_lens([7, 7, 1, 1, 1, 5], 1, 3, 2) == [1, 5]
    assert frozen_kv_mtp.padded_request_seq_lens([7, 7, 1, 1, 1, 1], 1, 3, 2) == [1, 1]
    assert frozen_kv_mtp.padded_request_seq_lens([7, 7], 1, 1, 2) == []


def test_uno_routing_runs_each_requests_anchor_on_the_base_model_and_its_proposals_on_the_adapter():
    assert uno.expected_routing("lora", 2, 4) == ([None, uno.LORA_ID, None, uno.LORA_ID], [1, 3, 1, 3])
    assert uno.expected_routing("nolora", 2, 4) is None
    assert uno.expected_routing("lora", 2, 1) is None  # F = 1: no proposal rows, one base-only graph


def test_the_runners_ranks_and_layouts():
    by_kind = {r.kind: r for r in OTHER_RUNNERS}
    assert by_kind["frozen_kv_mtp"].ranks((MLP_TP,)) == [(MLP_TP, 0, 0), (MLP_TP, 1, 2)]  # the first rank of each DP group
    assert [lay.describe() for lay, _d, _r in by_kind["uno"].ranks((MLP_TP, ATTN_TP))] == ["tp1 [neither]"]  # UNO: TP 1 only
    assert {lay.branch for lay, _d, _r in by_kind["ragged_verify"].ranks(())} == set(Branch)  # one DSpark layout per branch
    kept = [lay.describe() for lay, _why in dflash_verify.layouts((MLP_TP, ATTN_TP))]
    assert kept == ["tp4-dense_tp1 [attn_tp_gather]", "tp4-dp2-dp_lm_head [mlp_tp_gather]"]  # DP attention needs the dp lm head


def test_ragged_scheduled_verify_lengths_vary_and_always_verify_the_anchor():
    assert ragged_verify.verify_lens(_live(3, it=1), 4, "scheduled") == [2, 3, 4]
    assert ragged_verify.verify_lens(_live(3), 4, "verify-all") == [4, 4, 4]


def _ragged_replay(staged_lens: list[int], staged_qo: list[int], slots: int) -> list[str]:
    """_check_replay on a hand-made replay of 2 requests with verify lengths [2, 3] at tier 8 (no gathered buffer)."""
    window = {"input_ids": [1] * 8, "positions": [1] * 8, "out_cache_loc": [1] * 8}
    got = ragged_verify.TierReplay(8, slots, None, None, {"seq_lens": [5, 6] + [1] * (slots - 2), **window}, staged_lens, staged_qo,
                                   11 + slots - 2)
    rv = types.SimpleNamespace(T=4, tiers=[4, 8, 16], captures={8: types.SimpleNamespace(slots=slots)})
    v = Line("ragged_verify", 0, ParallelLayout(4), 8).verdict
    ragged_verify._check_replay(v, {}, ParallelLayout(4), rv, got, [2, 3], window, 8, 1)
    return sorted(f"{f.check} {f.field}" for f in v.failures)


def test_ragged_staged_layout_keeps_the_real_rows_and_spreads_the_leftover_over_the_padding_slots():
    assert _ragged_replay([2, 3, 2, 1], [0, 2, 5, 7, 8], 4) == []  # the leftover 3 tokens on the two padding slots
    # the capture-time synthetic layout left in place (no staging): request 1's tokens would start at row 2, its length 2
    assert _ragged_replay([2, 2, 2, 2], [0, 2, 4, 6, 8], 4) == ["replay verify_lens real rows"]
    assert _ragged_replay([1, 2, 2, 3], [0, 1, 3, 5, 8], 4) == ["replay qo_indptr real rows", "replay verify_lens real rows"]
    # no padding slot: the last request absorbs the leftover up to T, its own tokens first
    assert _ragged_replay([2, 4], [0, 2, 6], 2) == []
    assert _ragged_replay([2, 2], [0, 2, 4], 2) == ["replay verify_lens last real row"]


def _dp_groups(tiers: list[int], fills: list[list[int]]) -> list[str]:
    shared = {("verify-all", 0): {d: (t, fill, d * 2, {"rank": d * 2}) for d, (t, fill) in enumerate(zip(tiers, fills, strict=True))}}
    lines: dict = {}
    ragged_verify.finish(MLP_TP, shared, lambda runner, step, bs: lines.setdefault(bs, Line(runner, step, MLP_TP, bs)))
    return sorted(f"{f.where['rank']} {f.expected} {f.got}" for ln in lines.values() for f in ln.verdict.failures)


def test_dp_groups_must_launch_one_tier_in_the_mlp_tp_branch():
    assert _dp_groups([8, 8], [[8, 8], [8, 8]]) == []
    # group 0 launches tier 4 and tells the gather both send 4; group 1 launches 8 and says 8: each fill is wrong for the other
    assert _dp_groups([4, 8], [[4, 4], [8, 8]]) == ["0 [4, 8] [4, 4]", "2 [4, 8] [8, 8]"]


# ---- the installed releases, each checked once ----

CHECK = """
    import json
    from pathlib import Path
    from harness.engines.check import check_engine
    from harness.engines.install import deps_dir
    from harness.engines.options import Selection
    from harness.engines.sglang.loader import load
    from runners.parallel.layout import ParallelLayout
    eng = load(Path({target!r}), deps_dir())
    rep = check_engine(eng, tuple([{layouts}]), kernel_layouts=(), selection=Selection(runners=frozenset({kinds!r})))
    lines = [dict(runner=ln.runner, step=ln.step, branch=ln.layout.branch.value, layout=ln.layout.describe(), bucket=ln.bucket,
                  ok=ln.verdict.ok, checked=ln.verdict.checked,
                  failures=[dict(check=f.check, field=f.field, expected=f.expected, got=f.got,
                                 where={{k: v for k, v in f.where.items() if k in ("raw_bs", "bs", "iteration", "layout_source", "dp_tiers")}})
                            for f in ln.verdict.failures]) for ln in rep.lines]
    print(json.dumps(dict(lines=lines, skipped=rep.skipped)))
"""


def _check(target: Path, layouts: str, kinds: list[str] = KINDS) -> dict:
    proc = run_python(textwrap.dedent(CHECK.format(target=str(target), layouts=layouts, kinds=sorted(kinds))), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _findings(doc: dict) -> set[tuple]:
    """(runner, step, branch, check, field) of every failure."""
    return {(ln["runner"], ln["step"], ln["branch"], f["check"], f["field"]) for ln in doc["lines"] for f in ln["failures"]}


LAYOUTS = "ParallelLayout(4, 2, True), ParallelLayout(4, 1, False, 1)"  # MLP-TP gather, attn-TP gather


@pytest.fixture(scope="module")
def newest() -> Path:
    return installed_release(NEWEST)


@pytest.fixture(scope="module")
def newest_run(newest: Path, tmp_path_factory) -> dict:
    return computed_once(tmp_path_factory, f"sglang-{NEWEST}-runners", lambda: _check(newest, LAYOUTS))


FROZEN_BUCKET = {("frozen_kv_mtp", 0, "mlp_tp_gather", "padding", f) for f in ("bs >= raw_bs", "returned rows", "seq_lens_sum")}
RAGGED_DP = {("ragged_verify", 0, "mlp_tp_gather", "DP", "global_num_tokens_gpu (every DP group's tier)")}


@pytest.mark.engine
def test_newest_release_findings_are_the_frozen_dp_bucket_and_the_ragged_dp_tier(newest_run):
    assert _findings(newest_run) == FROZEN_BUCKET | RAGGED_DP
    lines = newest_run["lines"]
    assert {ln["runner"] for ln in lines} == set(KINDS) and all(ln["checked"] > 0 for ln in lines)
    # Frozen-KV MTP at topk 2, DP groups of 4 requests each: 8 tokens per group (4 x topk), and execute() divides the largest by
    # topk x topk: bucket 8 // 4 = 2, half the requests
    frozen = [f for ln in lines if ln["runner"] == "frozen_kv_mtp" for f in ln["failures"] if f["field"] == "bs >= raw_bs"]
    assert any(f["where"]["raw_bs"] == 4 and f["where"]["bs"] == 2 for f in frozen), frozen[:3]
    # the dense DSpark draft keys its tier by its own requests: 1 and 2 requests (x T = 4) are tiers 4 and 8
    dp = [f for ln in lines if ln["runner"] == "ragged_verify" for f in ln["failures"]]
    assert any(f["where"]["dp_tiers"] == [4, 8] and f["expected"] == [4, 8] and f["got"] in ([4, 4], [8, 8]) for f in dp), dp[:3]


@pytest.mark.engine
def test_newest_release_uno_and_dflash_pass_where_they_run(newest_run):
    lines = newest_run["lines"]
    uno_lines = [ln for ln in lines if ln["runner"] == "uno"]
    assert {(ln["layout"], ln["step"]) for ln in uno_lines} == {("tp1 [neither]", 0), ("tp1 [neither]", 1)}
    assert all(ln["ok"] for ln in uno_lines) and len(uno_lines) == 10  # 5 buckets, the draft and the verify pass
    dflash = {ln["layout"] for ln in lines if ln["runner"] == "dflash_verify"}
    assert dflash == {"tp4-dense_tp1 [attn_tp_gather]", "tp4-dp2-dp_lm_head [mlp_tp_gather]"}  # no tp4-dp2: no dp lm head
    ragged = {ln["layout"] for ln in lines if ln["runner"] == "ragged_verify"}
    assert ragged == {"tp4-dp2-dp_lm_head [mlp_tp_gather]", "tp4-dense_tp1 [attn_tp_gather]", "tp4 [neither]"}


@pytest.mark.engine
def test_what_the_runners_never_check_is_said_with_the_reason(newest_run):
    skipped = newest_run["skipped"]
    for start in ("uno: the gathered-buffer invariants", "uno: tree mode", "ragged_verify: the Triton twins", "dflash_draft (",
                  "frozen_kv_mtp: the padded request rows"):
        assert any(why.startswith(start) for why in skipped), (start, skipped)
    assert not any("off unless named" in why for why in skipped if why.split(" ")[0] in KINDS)


@pytest.mark.engine
def test_unnamed_the_runners_are_said_off(newest):
    doc = _check(newest, "ParallelLayout(4)", kinds=["single_layer"])
    assert {ln["runner"] for ln in doc["lines"]} == {"single_layer"}
    off = [why.split(" ")[0] for why in doc["skipped"] if "not checked: off unless named" in why]
    assert sorted(off) == sorted(KINDS), doc["skipped"]


@pytest.mark.engine
def test_first_ragged_release_replays_the_capture_time_layout(tmp_path):
    # 0.5.16 keys the verify graphs by tier but never refreshes the layout the graph baked (0.5.17's
    # _stage_ragged_verify_layout: "Without this refresh every replay reuses the capture-time synthetic verify_lens /
    # qo_indptr and mis-slices the packed q rows"); UNO is not in it yet
    doc = _check(installed_release(FIRST_RAGGED), LAYOUTS)
    ragged = {f[3:] for f in _findings(doc) if f[0] == "ragged_verify"}
    assert {("replay", "qo_indptr real rows"), ("replay", "verify_lens real rows")} <= ragged, ragged
    assert any(why.startswith("uno (UnoDecodeCudaGraphRunner): n/a: the release ships no") for why in doc["skipped"])
    assert {f for f in _findings(doc) if f[0] == "frozen_kv_mtp"} == FROZEN_BUCKET
    assert not [f for f in _findings(doc) if f[0] == "dflash_verify"]


@pytest.mark.engine
def test_a_release_where_every_named_runner_is_na_is_na():
    # 0.5.13.post1: Frozen-KV MTP on the CudaGraphRunner-era API, no UNO yet: exit 3 with both reasons, before anything is built
    code = f"""
        from pathlib import Path
        from harness.engines.check import check_engine
        from harness.engines.install import deps_dir
        from harness.engines.options import Selection
        from harness.engines.sglang.errors import ReleaseNotCovered
        from harness.engines.sglang.loader import load
        eng = load(Path({str(installed_release("0.5.13.post1"))!r}), deps_dir())
        try:
            check_engine(eng, selection=Selection(runners=frozenset({{"frozen_kv_mtp", "uno"}})))
        except ReleaseNotCovered as e:
            print("n/a:", e)
    """
    proc = run_python(textwrap.dedent(code), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("n/a: frozen_kv_mtp: its FrozenKVMTPCudaGraphRunner has no execute") and "; uno: the release ships no" in last, last


# ---- planted one-line bugs: two copies of the newest release, one plant per runner in each ----

FROZEN = "sglang/srt/speculative/frozen_kv_mtp_cuda_graph_runner.py"
UNO_LORA = "sglang/srt/speculative/uno_lora.py"
UNO_RUNNER = "sglang/srt/speculative/uno_cuda_graph_runner.py"
DECODE = "sglang/srt/model_executor/runner/decode_cuda_graph_runner.py"
DFLASH_INFO = "sglang/srt/speculative/dflash_info.py"


def _plant(src: Path, dst: Path, plants: list[tuple[str, str, str]]) -> Path:
    """dst: a view of src through symlinks (tests/helpers/planted.py), except each planted file, a real copy with its `old` replaced by `new` (exactly once)."""
    texts: dict[str, str] = {}
    for rel, old, new in plants:  # plants in one file apply in turn
        text = texts.get(rel) or (src / rel).read_text()
        if text.count(old) != 1:
            pytest.skip(f"sglang at {src.name}: {rel} does not have {old.strip()!r} exactly once")
        texts[rel] = text.replace(old, new)
    return planted_copy(src, dst, texts)


def _added(newest_run: dict, planted: dict) -> dict[str, set[tuple]]:
    """Per runner, the (step, branch, check, field) failures the plants added to the unmodified release's."""
    base = _findings(newest_run)
    out: dict[str, set[tuple]] = {k: set() for k in KINDS}
    for f in _findings(planted) - base:
        out[f[0]].add(f[1:])
    return out


# (file, old, new): two copies of the newest release, one plant per runner in each
PLANTS_A = [
    # Frozen-KV MTP: execute() no longer points padded rows at the reserved request slot 0
    (FROZEN, "            buffers.req_pool_indices.zero_()\n", "            pass\n"),
    # UNO: the draft graph's routing runs each request's anchor on the adapter and one proposal on the base model
    (UNO_LORA, "segment_lens=[1, self.forward_width - 1] * batch_size,", "segment_lens=[self.forward_width - 1, 1] * batch_size,"),
    # ragged verify: the live layout's token offsets are no longer staged into the captured layout
    (DECODE, "        cap_layout.qo_indptr_device.copy_(live.qo_indptr_device)\n", "        pass\n"),
    # DFlash: the verify graph is captured for a block one token narrower than the runner's width
    (DECODE, "                positions=None,\n                draft_token_num=self.captured_req_width,\n",
     "                positions=None,\n                draft_token_num=self.captured_req_width - 1,\n"),
]
PLANTS_B = [
    # Frozen-KV MTP: the replay fill tells the DP gather requests where the graph baked tokens (bs * topk)
    (FROZEN, "            buffers.global_num_tokens_gpu.fill_(expanded_bs)\n", "            buffers.global_num_tokens_gpu.fill_(bs)\n"),
    # UNO: the draft pass selects the verify pass's graph (no adapter)
    (UNO_RUNNER, '            return "lora"\n', '            return "nolora"\n'),
    # ragged verify: the live layout is staged uncapped, so the tier's leftover tokens make rows longer than the verify window
    (DECODE, "padded_bs=cap_layout.bs, cap=self.captured_req_width", "padded_bs=cap_layout.bs, cap=None"),
    # DFlash: the verify input reports one token per request as its width
    (DFLASH_INFO, "            self.num_tokens_per_req = int(self.draft_token_num)\n", "            self.num_tokens_per_req = 1\n"),
]


@pytest.fixture(scope="module")
def planted_a(newest: Path, tmp_path_factory) -> dict:
    return computed_once(tmp_path_factory, f"sglang-{NEWEST}-runners-planted-a",
                         lambda: _check(_plant(newest, tmp_path_factory.mktemp("a") / "sglang", PLANTS_A), LAYOUTS))


@pytest.fixture(scope="module")
def planted_b(newest: Path, tmp_path_factory) -> dict:
    return computed_once(tmp_path_factory, f"sglang-{NEWEST}-runners-planted-b",
                         lambda: _check(_plant(newest, tmp_path_factory.mktemp("b") / "sglang", PLANTS_B), LAYOUTS))


@pytest.mark.engine
def test_frozen_plants_are_caught_on_its_lines(newest_run, planted_a, planted_b):
    a, b = _added(newest_run, planted_a)["frozen_kv_mtp"], _added(newest_run, planted_b)["frozen_kv_mtp"]
    # a batch that pads after a larger one finds that batch's request slots in its padded rows (both gathered branches)
    assert {(0, br, c, "req_pool_indices") for br in ("mlp_tp_gather", "attn_tp_gather") for c in ("pad value", "canonical")} <= a, a
    assert {f[2:] for f in a} == {("pad value", "req_pool_indices"), ("canonical", "req_pool_indices")}, a
    assert {(0, br, "fill", "global_num_tokens_gpu (replay fill)") for br in ("mlp_tp_gather", "attn_tp_gather")} <= b, b
    assert {(0, br, "I1", "global_num_tokens_gpu") for br in ("mlp_tp_gather", "attn_tp_gather")} <= b, b
    # and the capture's host counts (the body's set_dp_buffer_len: bs * topk) against the fill: I1 again
    assert {f[3] for f in b} == {"global_num_tokens_gpu (replay fill)", "global_num_tokens_gpu", "global_num_tokens_cpu"}, b


@pytest.mark.engine
def test_uno_plants_are_caught_on_its_lines(newest_run, planted_a, planted_b):
    a, b = _added(newest_run, planted_a)["uno"], _added(newest_run, planted_b)["uno"]
    assert a == {(0, "neither", "capture", "LoRA routing")}, a  # the draft pass's graph only
    assert b == {(0, "neither", "replay", "graph variant")}, b


@pytest.mark.engine
def test_ragged_plants_are_caught_on_its_lines(newest_run, planted_a, planted_b):
    a, b = _added(newest_run, planted_a)["ragged_verify"], _added(newest_run, planted_b)["ragged_verify"]
    assert {f[2:] for f in a} == {("replay", "qo_indptr real rows")}, a
    assert {f[1] for f in a} == {"mlp_tp_gather", "attn_tp_gather", "neither"}, a
    # scheduled lengths leave a leftover larger than the padding slots take at T each (or, with none, the last request takes it)
    assert ("replay", "verify_lens range") in {f[2:] for f in b}, b
    assert {f[2:] for f in b} <= {("replay", "verify_lens range"), ("replay", "verify_lens last real row")}, b


@pytest.mark.engine
def test_dflash_plants_are_caught_on_its_lines(newest_run, planted_a, planted_b):
    a, b = _added(newest_run, planted_a)["dflash_verify"], _added(newest_run, planted_b)["dflash_verify"]
    assert {f[2:] for f in a} == {("capture", "spec_info.draft_token_num")}, a
    assert {f[2:] for f in b} == {("raised", "DecodeCudaGraphRunner for DFLASH (TARGET_VERIFY)'s replays")}, b  # refused: eager
