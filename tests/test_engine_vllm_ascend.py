"""engine-check on vllm-ascend's merged EAGLE draft ACL graph.

The adapter's pieces on hand-built inputs (no download): the install's unpacking and vLLM pairing, the capture keys,
the model-runner methods compiled from a release's source, the NPU runtime stand-in, and the checks on hand-worked
replay records. Then, once the user opts in to engine installs: 0.23.0.post1 installed and checked (every invariant
holds but the draft steps' KV length, the divergence docs/engine-check-vllm-ascend.md describes), and one-line bugs
planted into copies of the installed tree, each caught by the check that owns it. Each check runs in its own
process (the adapter swaps module globals process-wide); the release and its planted copies run concurrently.
"""
from __future__ import annotations

import contextlib
import io
import json
import tarfile
import textwrap
import types
from pathlib import Path

import pytest
import torch

from harness.engines.install import InstallError
from harness.engines.sglang.errors import EngineAdapterError
from harness.engines.vllm_ascend.checks import capture_keys, check_tasks, expected_key, settled_sizes
from harness.engines.vllm_ascend.command import parse_spec
from harness.engines.vllm_ascend.config import AscendCheckConfig, GraphMode
from harness.engines.vllm_ascend.drive import AscendReplay, Capture
from harness.engines.vllm_ascend.install import _unpack, paired_vllm, sdist_link
from harness.engines.vllm_ascend.loader import compile_runner_methods, v2_runner_note
from harness.engines.vllm_ascend.npu import NpuRuntime, RankTables, build_modules
from harness.engines.vllm_ascend.runner import FIRST_BLOCK, blocks_per_request
from harness.verdict import Verdict
from tests.helpers.engine_releases import installed_ascend
from tests.helpers.planted import planted_copy
from tests.helpers.prewarmed import Started
from tests.helpers.shared import computed_once

VERSION = "0.23.0.post1"
PROPOSER = "vllm_ascend/spec_decode/llm_base_proposer.py"
RUNNER = "vllm_ascend/worker/model_runner_v1.py"

MATRIX = """
| vLLM Ascend | vLLM              | Python          |
|-------------|-------------------|-----------------|
| v0.23.0.post1 | v0.23.0           | >= 3.10, < 3.13 |
| v0.22.1rc1  | v0.22.1           | >= 3.10, < 3.13 |
"""


def test_paired_vllm_is_the_release_row_of_the_matrix():
    assert paired_vllm(MATRIX, "0.23.0.post1") == "0.23.0"
    assert paired_vllm(MATRIX, "0.22.1rc1") == "0.22.1"
    assert paired_vllm(MATRIX, "0.23.0") is None  # no row of its own: never a neighbour's


def _sdist(path: Path, version: str, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm_ascend-{version}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_unpack_keeps_the_python_tree_and_reads_the_pairing(tmp_path):
    sdist = _sdist(tmp_path / "a.tar.gz", "9.9.9", {"vllm_ascend/__init__.py": "X = 1\n", "vllm_ascend/worker/w.py": "",
                                                    "csrc/kernel.cpp": "", "docs/source/community/versioning_policy.md":
                                                    "| v9.9.9 | v0.23.0 | x |\n"})
    (tmp_path / "t").mkdir()
    assert _unpack(sdist, "9.9.9", tmp_path / "t") == ("0.23.0", "docs/source/community/versioning_policy.md, row v9.9.9")
    assert (tmp_path / "t/vllm_ascend/__init__.py").read_text() == "X = 1\n"
    assert (tmp_path / "t/vllm_ascend/worker/w.py").is_file()
    assert not (tmp_path / "t/csrc").exists()  # the compiled ops' sources: never built here


def test_unpack_pairs_a_release_missing_from_its_matrix_by_its_dockerfile(tmp_path):
    matrix = {"vllm_ascend/__init__.py": "", "docs/source/community/versioning_policy.md": "| v9.9.8 | v0.22.0 | x |\n"}
    sdist = _sdist(tmp_path / "a.tar.gz", "9.9.9", {**matrix, "Dockerfile": "FROM x\nARG VLLM_TAG=v0.25.1\nRUN y\n"})
    (tmp_path / "t").mkdir()
    assert _unpack(sdist, "9.9.9", tmp_path / "t") == ("0.25.1", "Dockerfile, ARG VLLM_TAG (no row for v9.9.9 in "
                                                                 "docs/source/community/versioning_policy.md)")
    (tmp_path / "u").mkdir()
    with pytest.raises(InstallError, match="no row for v9.9.9 .* and no ARG VLLM_TAG"):
        _unpack(_sdist(tmp_path / "b.tar.gz", "9.9.9", matrix), "9.9.9", tmp_path / "u")


def test_sdist_link_is_the_index_anchor_with_its_sha256(tmp_path):
    index = tmp_path / "index.html"
    index.write_text('<html><body><a href="../../files/x/vllm_ascend-9.9.9-cp311.whl#sha256=aa">vllm_ascend-9.9.9-cp311.whl</a>\n'
                     '<a href="https://files.example/p/vllm_ascend-9.9.9.tar.gz#sha256=bb" data-requires-python="">'
                     'vllm_ascend-9.9.9.tar.gz</a>\n<a href="../y/vllm_ascend-9.9.10.tar.gz">vllm_ascend-9.9.10.tar.gz</a></body></html>')
    assert sdist_link("9.9.9", index.as_uri()) == ("https://files.example/p/vllm_ascend-9.9.9.tar.gz", "bb")
    with pytest.raises(InstallError, match="carries no sha256"):
        sdist_link("9.9.10", index.as_uri())
    with pytest.raises(InstallError, match="lists no vllm_ascend-9.9.8.tar.gz"):
        sdist_link("9.9.8", index.as_uri())


def test_the_v2_runner_note_reads_the_workers_refusal(tmp_path):
    worker = tmp_path / "vllm_ascend/worker/worker.py"
    worker.parent.mkdir(parents=True)
    worker.write_text("x = 1\n        if self.use_v2_model_runner and vllm_version_is(\"0.23.0\"):\n            pass\n")
    assert "on vllm 0.23.0 the worker falls back to the v1 runner (vllm_ascend/worker/worker.py:2)" in v2_runner_note(tmp_path, "0.23.0")
    assert "off by default" in v2_runner_note(tmp_path, "0.24.0")  # a refusal of another vLLM: v2 is merely off


def test_engine_spec_names_vllm_ascend_only():
    assert (parse_spec("vllm-ascend==0.23.0.post1").name, parse_spec("vllm-ascend==0.23.0.post1").version) == ("vllm-ascend", VERSION)
    assert parse_spec(" vllm-ascend ").version is None
    for bad in ("vllm==0.23.0", "vllm-ascend=="):
        with pytest.raises(ValueError):
            parse_spec(bad)


def test_capture_keys_follow_vllm_rounding_and_the_dispatcher_rules():
    cfg = AscendCheckConfig()  # K = 3, max_num_seqs 8, sizes 1, 2, 4, 8, 16, 24, 32
    assert settled_sizes(cfg) == [4, 8, 16, 24, 32]  # round_up(1, 4) = round_up(2, 4) = 4
    assert capture_keys(cfg, GraphMode.FULL_DECODE_ONLY) == [(4, 1, True), (8, 2, True), (16, 4, True), (24, 6, True), (32, 8, True)]
    assert capture_keys(cfg, GraphMode.FULL) == [(4, 4, False), (8, 8, False), (16, 8, False), (24, 8, False), (32, 8, False)]
    assert expected_key(cfg, GraphMode.FULL_DECODE_ONLY, 12) == (16, 4, True)  # 3 requests in the 4-request graph
    assert expected_key(cfg, GraphMode.FULL, 20) == (24, 8, False)
    assert expected_key(cfg, GraphMode.FULL_DECODE_ONLY, 36) is None  # 9 requests: no graph, eager


RUNNER_SOURCE = """\
import torch


class NPUModelRunner:
    def _use_aclgraph(self):
        return self.graphs

    def _sync_metadata_across_dp(self, num_tokens):
        return _post_process_cudagraph_mode(torch.tensor([[0, 0], [num_tokens, 3]]))

    def _pad_query_start_loc_for_fia(self, n):
        return n + self.pad


def _post_process_cudagraph_mode(tensor):
    return int(tensor[1, :].min().item())
"""


def test_runner_methods_are_compiled_from_the_release_source(tmp_path):
    path = tmp_path / "model_runner_v1.py"
    path.write_text(RUNNER_SOURCE)
    methods, where = compile_runner_methods(path, "9.9.9", {"torch": lambda: torch})
    runner = types.SimpleNamespace(graphs=True, pad=2)
    assert methods["_use_aclgraph"](runner) is True
    assert methods["_sync_metadata_across_dp"](runner, 7) == 3  # through the module function, min over the row
    assert methods["_pad_query_start_loc_for_fia"](runner, 5) == 7
    assert where["_sync_metadata_across_dp"].endswith("model_runner_v1.py:8")
    assert where["_post_process_cudagraph_mode"].endswith("model_runner_v1.py:15")


def test_a_runner_method_reading_an_unprovided_global_is_refused(tmp_path):
    path = tmp_path / "model_runner_v1.py"
    path.write_text(RUNNER_SOURCE.replace("return n + self.pad", "return n + get_pad()"))
    with pytest.raises(EngineAdapterError, match=r"model_runner_v1.py:11 _pad_query_start_loc_for_fia reads get_pad"):
        compile_runner_methods(path, "9.9.9", {"torch": lambda: torch})


def _runtime() -> tuple[NpuRuntime, types.ModuleType, types.ModuleType]:
    rt = NpuRuntime()
    rt.forward_context = types.SimpleNamespace(is_forward_context_available=lambda: False,
                                               override_forward_context=lambda ctx: contextlib.nullcontext())
    npu, torch_npu = build_modules(rt)
    return rt, npu, torch_npu


def test_a_captured_attention_task_records_its_rows_and_every_update():
    rt, npu, torch_npu = _runtime()
    g = npu.NPUGraph()
    query = torch.zeros(6, 1, 2)
    with npu.graph(g):
        npu.graph_task_group_begin(None)
        torch_npu.npu_fused_infer_attention_score.out(query=query, actual_seq_lengths=[3, 6], actual_seq_lengths_kv=[9, 0],
                                                      block_table=torch.tensor([[4], [0]]), out=[torch.zeros(6, 1, 2), None])
        handle = npu.graph_task_group_end(None)
    assert (handle.index, handle.query_rows) == (0, 6)
    assert handle.captured == {"actual_seq_lengths": [3, 6], "actual_seq_lengths_kv": [9, 0], "block_table": [[4], [0]]}
    npu.graph_task_update_begin(None, handle)
    torch_npu.npu_fused_infer_attention_score.out(query=query, actual_seq_lengths=[1, 2, 3, 4, 5, 6],
                                                  actual_seq_lengths_kv=[10, 0, 0, 0, 0, 0], block_table=None, out=[None, None])
    npu.graph_task_update_end(None)
    assert handle.updates == [(0, {"actual_seq_lengths": [1, 2, 3, 4, 5, 6], "actual_seq_lengths_kv": [10, 0, 0, 0, 0, 0],
                                   "block_table": None})]


def test_kv_writes_skip_padding_slots_and_do_not_run_while_captured():
    rt, npu, torch_npu = _runtime()
    cache = torch.zeros(2, 4, 2, 1, 2)  # [k/v, blocks, block size, heads, head size]: slots 0..7
    key = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]]])
    with npu.graph(npu.NPUGraph()):
        torch_npu._npu_reshape_and_cache(key, key, cache[0], cache[1], torch.tensor([5, -1, 2]))
    assert not cache.any() and rt.kv_writes == []  # a capture records the kernel; it runs at replay
    torch_npu._npu_reshape_and_cache(key, key, cache[0], cache[1], torch.tensor([5, -1, 2]))
    assert cache[0].view(8, 2)[5].tolist() == [1.0, 2.0] and cache[0].view(8, 2)[2].tolist() == [5.0, 6.0]
    assert int((cache[0].view(8, 2) != 0).any(dim=1).sum()) == 2  # the -1 row wrote nothing
    assert [w.slots for w in rt.kv_writes] == [[5, -1, 2]]


def test_an_npu_op_outside_the_driven_path_refuses_to_run_naming_itself():
    _, npu, torch_npu = _runtime()
    op = torch_npu.npu_moe_gating_top_k  # reading it is fine: modules read ops and dtypes at import
    with pytest.raises(EngineAdapterError, match="torch_npu.npu_moe_gating_top_k"):
        op(torch.zeros(1))


def test_graph_parameter_tables_are_per_rank():
    rt, _, _ = _runtime()
    rank = {"now": 0}
    rt.rank_of = lambda: rank["now"]
    tables = RankTables(rt)
    tables.tables[0] = types.SimpleNamespace(handles={4: ["a"]})
    tables.tables[1] = types.SimpleNamespace(handles={4: ["b", "c"]})
    assert tables.handles[4] == ["a"]
    rank["now"] = 1
    assert tables.handles[4] == ["b", "c"]
    rank["now"] = 2
    with pytest.raises(EngineAdapterError, match="rank 2"):
        _ = tables.handles


# A hand-worked replay: K = 2 (3 tokens a request), one request in the 2-request graph (6 tokens). The request had
# 47 tokens, verified 3 at positions 47, 48, 49 (seq_len 50) and accepted one draft: its last accepted token is at 48,
# so draft step 1 writes position 49 and attends 50 KV entries.
CFG = AscendCheckConfig(num_speculative_tokens=2, max_num_seqs=4, cudagraph_capture_sizes=(3, 6, 12), max_model_len=128)
ROW0 = [FIRST_BLOCK + k for k in range(blocks_per_request(CFG))]


def _replay(step1_kv: list[int], updates_step1: int = 1) -> AscendReplay:
    step0 = {"actual_seq_lengths": [3, 6], "actual_seq_lengths_kv": [50, 0], "block_table": [ROW0, [0] * len(ROW0)]}
    step1 = {"actual_seq_lengths": [1, 2, 3, 4, 5, 6], "actual_seq_lengths_kv": step1_kv,
             "block_table": [ROW0] + [[0] * len(ROW0)] * 5}
    cap = Capture(6, 2, True, None, {"num_input_tokens": 6, "batch_size": 2, "sample_rows": 2, "dp_tokens": None})
    rep = AscendReplay(0, 0, [1], 1, {"seq_lens": [50], "sampled_positions": [48], "rejected": [1], "next_ids": [2000],
                                      "sample_idx": [1]}, "FULL", 6, None, (6, 2, True), cap, 1)
    rep.tasks = [{"rows": 6, "captured": {}, "updates": [step0]}, {"rows": 6, "captured": {}, "updates": [step1] * updates_step1}]
    return rep


def _failures(rep: AscendReplay) -> list[tuple[str, str, object, object]]:
    v = Verdict("P1")
    check_tasks(v, rep, rep.capture, CFG, {})
    return [(f.check, f.field, f.expected, f.got) for f in v.failures]


def test_task_checks_pass_a_replay_whose_lengths_are_the_requests():
    assert _failures(_replay([50, 0, 0, 0, 0, 0])) == []


def test_task_checks_name_a_draft_step_attending_past_its_position():
    # 51 = seq_len 50 + 1, the rejected draft's KV entry at position 50 included: what 0.23.0.post1 does
    assert _failures(_replay([51, 0, 0, 0, 0, 0])) == [("kv length", "step 1 kv lengths (real lanes)", [50], [51])]


def test_task_checks_name_a_task_the_host_did_not_rewrite():
    assert _failures(_replay([50, 0, 0, 0, 0, 0], updates_step1=0)) == [("NPU tasks", "updates before the replay ran", 1, 0)]


# --- the installed release and planted copies (opt-in: downloads the sdist and vLLM) ---------------------------------

# id -> (file, the line as released, the planted line): each a bug in a piece the check drives
PLANTED = {
    # steps 1..: the slots past the live lanes are filled with 0 instead of PADDING_SLOT_ID (padded rows write KV into
    # block 0, someone's cache)
    "padded_slots_not_padding": (PROPOSER, "self.slot_mapping_group[draft_index][slot_mapping.shape[0] :].fill_(PADDING_SLOT_ID)",
                                 "self.slot_mapping_group[draft_index][slot_mapping.shape[0] :].fill_(0)"),
    # the sampled-row buffer's tail is left as the last larger batch wrote it
    "sampled_rows_tail_stale": (PROPOSER, "self.token_indices_to_sample[token_indices_to_sample_len:].fill_(0)", "pass"),
    # steps 1.. build their metadata over the live requests, not the graph's rows: FIA's TND lengths stop short
    "draft_steps_over_live_requests": (PROPOSER, "common_attn_metadata.num_reqs = input_batch_size",
                                       "common_attn_metadata.num_reqs = batch_size"),
    # the draft's DP agreement pads each rank to its own count (a MoE draft's ranks replay different graphs)
    "dp_pads_to_own_count": (RUNNER, "max_tokens_across_dp = int(num_tokens_across_dp.max().item())",
                             "max_tokens_across_dp = int(num_tokens_across_dp[self.dp_rank].item())"),
    # the host no longer rewrites the graph's attention tasks after the replay is issued: they run with the capture's lengths
    "tasks_not_updated": (PROPOSER, "draft_token_ids = run_draft()\n                self._update_full_graph_params_if_needed(",
                          "draft_token_ids = run_draft()\n                (lambda *args: None)("),
}
# the worlds each copy drives (mode, dp, moe), fewer than the release's: its bug shows in them
PLANTED_WORLDS = {name: (("FULL_DECODE_ONLY", 1, False),) for name in PLANTED}
PLANTED_WORLDS["dp_pads_to_own_count"] = (("FULL_DECODE_ONLY", 2, True),)
PLANTED_WORLDS["draft_steps_over_live_requests"] = (("FULL_DECODE_ONLY", 1, False), ("FULL", 1, False))
# what each copy must newly fail: (check, field) pairs absent from the release's failures
CAUGHT = {
    "padded_slots_not_padding": {("padded tail", "step 1 slots"), ("padded tail", "step 2 slots")},
    "sampled_rows_tail_stale": {("padded tail", "sampled rows")},
    "draft_steps_over_live_requests": {("NPU tasks", "q lengths end (TND)"), ("lanes", "step 1 q lengths")},
    # (each rank's graph agrees with its own DP metadata, so capture = replay holds: the ranks disagree with each other)
    "dp_pads_to_own_count": {("DP", "num_input_tokens on every rank"), ("padding", "graph (mode, key)")},
    "tasks_not_updated": {("NPU tasks", "updates before the replay ran")},
}

_CHECK = """
    import json
    from pathlib import Path
    from harness.engines.install import deps_dir
    from harness.engines.vllm.install import vllm_deps_dir
    from harness.engines.vllm_ascend.command import check_ascend
    from harness.engines.vllm_ascend.config import AscendCheckConfig, GraphMode
    from harness.engines.vllm_ascend.install import paired_vllm_dir
    from harness.engines.vllm_ascend.loader import load
    tree = Path({tree!r})
    worlds = {worlds!r}
    cfg = AscendCheckConfig()
    if worlds is not None:
        cfg = AscendCheckConfig(modes=tuple(GraphMode[m] for m in dict.fromkeys(w[0] for w in worlds)),
                                dp_worlds=tuple(dict.fromkeys((w[1], w[2]) for w in worlds)))
    rep = check_ascend(load(tree, paired_vllm_dir(tree), [deps_dir(), vllm_deps_dir()]), cfg)
    print(json.dumps(rep.to_json(), default=str))
"""


def _plant(src: Path, dst: Path, rel: str, old: str, new: str) -> Path:
    """dst: a view of src through symlinks (tests/helpers/planted.py), except the edited file, a real copy with its line replaced (exactly once)."""
    text = (src / rel).read_text()
    if text.count(old) != 1:
        pytest.skip(f"vllm-ascend {VERSION}: {rel} does not have the line {old!r} exactly once")
    return planted_copy(src, dst, {rel: text.replace(old, new)})


@pytest.fixture(scope="module")
def installed() -> Path:
    return installed_ascend(VERSION)


@pytest.fixture(scope="module")
def results(installed, tmp_path_factory) -> dict[str, dict]:
    return computed_once(tmp_path_factory, f"vllm-ascend-{VERSION}-planted", lambda: _run_checks(installed, tmp_path_factory.mktemp("ascend-planted")))


def _run_checks(installed: Path, base: Path) -> dict[str, dict]:
    targets = {"release": (installed, None)}
    for name, (rel, old, new) in PLANTED.items():
        targets[name] = (_plant(installed, base / name, rel, old, new), PLANTED_WORLDS[name])
    procs = {name: Started(textwrap.dedent(_CHECK.format(tree=str(t), worlds=w))) for name, (t, w) in targets.items()}
    out = {}
    for name, p in procs.items():
        proc = p.result(timeout=600)
        assert proc.returncode == 0, f"{name}: " + proc.stdout[-2000:] + proc.stderr[-3000:]
        out[name] = json.loads(proc.stdout)
    return out


def _failed(rep: dict) -> set[tuple[str, str]]:
    return {(f["check"], f["field"]) for ln in rep["lines"] for f in ln["failures"]}


INSTALLS = pytest.mark.timeout(900)  # an install and six checks, on two cores


@pytest.mark.engine
@INSTALLS
def test_release_holds_every_invariant_but_the_draft_steps_kv_length(results):
    rep = results["release"]
    assert (rep["version"], rep["vllm"]) == (VERSION, "0.23.0")
    assert rep["ok"] is False
    assert _failed(rep) == {("kv length", "step 1 kv lengths (real lanes)"), ("kv length", "step 2 kv lengths (real lanes)")}
    worlds = {ln["world"] for ln in rep["lines"]}
    assert worlds == {"FULL_DECODE_ONLY dp=1", "FULL_DECODE_ONLY dp=2", "FULL_DECODE_ONLY dp=2 moe", "FULL dp=1", "FULL dp=2",
                      "FULL dp=2 moe"}
    first = next(f for ln in rep["lines"] for f in ln["failures"] if f["where"]["world"] == "FULL_DECODE_ONLY dp=1")
    # iteration 0: one request, 40 tokens, verified 4 at 40..43 and accepted none: step 1 writes position 41 and should
    # attend 42 entries; the release attends seq_len 44 + 1, the 3 rejected drafts' and one never-written entry included
    assert (first["where"]["iteration"], first["expected"], first["got"]) == (0, [42], [45])
    # the v2 runner: the worker refuses it on the vLLM this release runs on (its line, read from the release)
    assert any("on vllm 0.23.0 the worker falls back to the v1 runner (vllm_ascend/worker/worker.py:161)" in n for n in rep["not_applicable"])


@pytest.mark.engine
@INSTALLS
def test_release_captures_one_graph_per_key_and_replays_it_with_rewritten_tasks(results):
    lines = {(ln["world"], ln["bucket"]): ln for ln in results["release"]["lines"]}
    assert lines[("FULL dp=1", "capture")]["captured_tokens"] == [4, 8, 16, 24, 32]
    assert lines[("FULL_DECODE_ONLY dp=2 moe", "capture")]["ok"]
    # 3 and 4 requests share the 16-token graph (a batch that shrinks within a bucket), on both ranks of the MoE world
    assert lines[("FULL_DECODE_ONLY dp=2 moe", "tokens=16")]["raw_bs"] == [1, 2, 3, 4]


@pytest.mark.engine
@INSTALLS
@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_planted_bug_is_caught_by_the_check_that_owns_it(results, planted):
    new = _failed(results[planted]) - _failed(results["release"])
    assert CAUGHT[planted] <= new, f"{planted}: newly failing {sorted(new)}"


@pytest.mark.engine
@INSTALLS
def test_a_tree_without_the_merged_draft_graph_is_not_applicable(installed, tmp_path):
    tree = _plant(installed, tmp_path / "gone", PROPOSER, "    def _run_merged_draft(", "    def _run_merged_draft_gone(")
    code = (f"import sys\nfrom harness.engines.command import main\nfrom types import SimpleNamespace\n"
            f"sys.exit(main(SimpleNamespace(engine='vllm-ascend', target={str(tree)!r}, deps=None, install=False, json=False, "
            f"eager=False, releases=None, all_layouts=False, path='all', runner=None)))\n")
    proc = Started(code).result(timeout=600)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "has no AscendSpecDecodeBaseProposer._run_merged_draft" in proc.stderr
