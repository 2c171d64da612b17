"""engine-check on vLLM's EAGLE proposer: the newest release and the newest token-keyed one (0.33) pass
(and say what does not apply), and bugs planted into installed copies are each caught by the check
that owns them.

Each release is installed once (cached under .engines/, under a file lock, as the SGLang tests
install theirs) where the run allows installs (tests/helpers/engine_releases.py), or its tests skip saying why. Each check runs in its own process (the
adapter swaps module globals process-wide); a release and its planted copies run concurrently,
once per session, since importing vLLM dominates their time.
"""
from __future__ import annotations

import argparse
import json
import os
import textwrap
import time
from pathlib import Path

import pytest
import torch

from harness.engines.command import add_arguments
from harness.engines.command import main as engine_check_main
from harness.engines.install import engines_root
from harness.engines.sglang.errors import EngineAdapterError
from harness.engines.vllm.api import DispatchOrder, RunnerQueryLenApi
from harness.engines.vllm.checks import expected_graph
from harness.engines.vllm.standins import DPWorld, Strict
from tests.helpers.engine_releases import installed_vllm
from tests.helpers.planted import planted_copy
from tests.helpers.prewarmed import Started

REPO = Path(__file__).resolve().parent.parent
VERSION = os.environ.get("SPECHARNESS_VLLM_NEWEST", "0.34.0")
TOKEN_KEYED = "0.33.0"  # the newest release whose decode graphs are keyed by token counts (cudagraph_capture_sizes)
CUDAGRAPH_UTILS = "vllm/v1/worker/gpu/cudagraph_utils.py"
KERNEL = "vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py"
DP_UTILS = "vllm/v1/worker/gpu/dp_utils.py"
COMPILATION = "vllm/config/compilation.py"
BLOCK_TABLE = "vllm/v1/worker/gpu/block_table.py"
AR = "vllm/v1/worker/gpu/spec_decode/autoregressive/speculator.py"  # 0.34: the decode loops, per-step and fused
# update_draft_inputs' kernel advancing a request's position for the next draft step (the decode-input kernel's line is
# the same text: the load before it tells them apart)
NEXT_STEP_POSITION = ("max_model_len = tl.load(max_model_len_ptr)\n        position = tl.load(positions_ptr + req_idx)\n"
                      "        position = tl.minimum(position + 1, max_model_len - 1)")
FUSED_LOOP = "for step in range(1, num_speculative_steps):\n            if attn_metadata is not None and ("  # the fused body's loop head

# id -> [(file, the line as released, the planted line)]: one copy per id, checked at DP sizes PLANTED_DP[id]
PLANTED = {
    # two padded-tail bugs, in two buffers (each failure names its buffer): the draft input kernels stop
    # zeroing seq_lens past the live requests (the prefill's and the decode's: propose() runs both on the same
    # buffer, so either one alone still leaves the tail at 0), and the slot-mapping kernel stops writing
    # PAD_SLOT_ID past the live tokens (padded lanes would write KV into live blocks)
    "padded_tail_not_written": [(KERNEL, "tl.store(seq_lens_ptr + block, 0, mask=mask)",
                                 "tl.store(seq_lens_ptr + block, 0, mask=mask & (block < 0))"),
                                (KERNEL, "tl.store(draft_seq_lens_ptr + block, 0, mask=mask)",
                                 "tl.store(draft_seq_lens_ptr + block, 0, mask=mask & (block < 0))"),
                                (BLOCK_TABLE, "tl.store(slot_mapping_ptr + offset, PAD_ID, mask=offset < max_num_tokens)",
                                 "tl.store(slot_mapping_ptr + offset, PAD_ID, mask=offset < 0)")],
    # the DP agreement pads each rank to its own count instead of the largest rank's
    "dp_pads_to_own_count": [(DP_UTILS, "synced_num_tokens = int(num_tokens_across_dp.max())",
                              "synced_num_tokens = int(num_tokens_across_dp[dp_rank])")],
    # uniform-decode graphs no longer respect the token cap at 1 + K tokens per request
    "capture_limit_ignores_query_len": [(COMPILATION, "limit = min(max_reqs, max_tokens // q)", "limit = min(max_reqs, max_tokens)")],
    # the fused multi-step graph body runs one draft step too many (the per-step loop's head, the same text, is left alone)
    "fused_graph_extra_step": [(AR, FUSED_LOOP, FUSED_LOOP.replace("num_speculative_steps):", "num_speculative_steps + 1):"))],
    # the fused graph body no longer refreshes the slot mappings and the attention metadata before a step: on a GPU its
    # replays would write KV through the slot mappings and attend with the metadata of the batch it was last refreshed for
    "fused_graph_skips_refresh": [(AR, "if attn_metadata is not None and (", "if attn_metadata is None and (")],
    # between draft steps (K = 3 worlds): update_draft_inputs stops advancing positions for the next step (seq_lens still
    # advance); the draft step's body is the same on both paths
    "next_step_positions_not_advanced": [(KERNEL, NEXT_STEP_POSITION, NEXT_STEP_POSITION.replace("position + 1,", "position,"))],
    # the per-step loop refreshes slot mappings and metadata before step 1 only, as if draft positions never advanced
    "per_step_refresh_only_first": [(AR, "if not skip_attn and (self.advance_draft_positions or step == 1):",
                                     "if not skip_attn and (step == 1):")],
    # the fused graph body likewise: steps 2 .. K - 1 write KV and attend with step 1's slot mappings and metadata
    "fused_refresh_only_first": [(AR, "    self.advance_draft_positions or step == 1\n            ):", "    step == 1\n            ):")],
}
# The release runs the default worlds and schedule, and shows that none of them fails without a bug. A planted copy
# runs only the worlds its bug is in (their time is the interpreted kernels'), over PLANTED_SCHEDULE: 4 requests (a
# captured size), 13 (padded to the 16 graph) and 23 (the 24 decode graph; above the verify-width cap, eager), each
# after a smaller and after a larger batch. The K = 2 world's DP sizes (the release: 1, 2, 4): the DP agreement's bug
# needs two ranks; the capture rule's shows at capture, at DP 1; the draft decode's bugs are in the K = 3 worlds.
PLANTED_SCHEDULE = (4, 13, 23)
PLANTED_DP = {"padded_tail_not_written": (), "dp_pads_to_own_count": (2,), "capture_limit_ignores_query_len": (1,)}
# the draft decode paths each planted copy drives (the release drives both): a copy whose bug is outside the draft
# decode needs one of them
PLANTED_PATHS = {"dp_pads_to_own_count": (False,), "capture_limit_ignores_query_len": (False,), "rounded_size_ignores_cap": (False,),
                 "fused_graph_extra_step": (True,), "fused_graph_skips_refresh": (True,), "per_step_refresh_only_first": (False,),
                 "fused_refresh_only_first": (True,)}
# the between-step copies drive only the K = 3 decode worlds (no K = 2 world), at DP 1
STEP_COPIES = ("next_step_positions_not_advanced", "per_step_refresh_only_first", "fused_refresh_only_first")
# (the fused-path copies drive the K = 3 fused worlds only, at DP 1: the kernels they break run per rank)
PLANTED_DP.update({name: () for name in (*STEP_COPIES, "fused_graph_extra_step", "fused_graph_skips_refresh")})
# the K = 3 decode worlds' DP sizes (the release: 1, 2): DP 1 for the draft decode's bugs, none for the others
PLANTED_DECODE_DP = {name: (1,) for name in (*STEP_COPIES, "padded_tail_not_written", "fused_graph_extra_step", "fused_graph_skips_refresh")}
PLANTED_DECODE_DP.update({name: () for name in ("dp_pads_to_own_count", "capture_limit_ignores_query_len", "rounded_size_ignores_cap")})

pytestmark = pytest.mark.timeout(900)

_CHECK = """
    import json
    from pathlib import Path
    from harness.engines.install import deps_dir
    from harness.engines.vllm.command import check_vllm
    from harness.engines.vllm.config import VllmCheckConfig
    from harness.engines.vllm.install import vllm_deps_dir
    from harness.engines.vllm.loader import load
    from harness.engines.vllm.report import format_report
    rep = check_vllm(load(Path({target!r}), [deps_dir(), vllm_deps_dir()]), VllmCheckConfig(**{overrides!r}))
    print(json.dumps({{"report": rep.to_json(), "text": format_report(rep)}}, default=str))
"""


# 0.33's token-keyed copies: id -> edits, and their DP sizes
PLANTED_TOKEN_KEYED = {
    # as in 0.34: the DP agreement pads each rank to its own count
    "dp_pads_to_own_count": PLANTED["dp_pads_to_own_count"],
    # the manager's token-keyed rule forgets the capture cap: 64 tokens round up to a 22-request (66-token) graph
    "rounded_size_ignores_cap": [(CUDAGRAPH_UTILS, "or rounded_num_tokens > max_cg_capture_size", "or False")],
}
PLANTED_TOKEN_KEYED_DP = {"dp_pads_to_own_count": (2,), "rounded_size_ignores_cap": (1,)}


def _plant(src: Path, dst: Path, edits: list[tuple[str, str, str]], version: str) -> Path:
    """dst: a view of src through symlinks (tests/helpers/planted.py), except each edited file, a real copy with its line replaced (exactly once)."""
    texts: dict[str, str] = {}
    for rel, old, new in edits:
        texts.setdefault(rel, (src / rel).read_text())
        if texts[rel].count(old) != 1:
            pytest.skip(f"vllm {version}: {rel} does not have the line {old!r} exactly once")
        texts[rel] = texts[rel].replace(old, new)
    return planted_copy(src, dst, texts)


def _run_checks(version: str, planted: dict, planted_dp: dict, base: Path) -> dict[str, dict]:
    """The release and each planted copy of it, checked concurrently: name -> {"report", "text"}."""
    release = installed_vllm(version)
    targets = {"release": release}
    for name, edits in planted.items():
        targets[name] = _plant(release, base / name, edits, version)
    overrides = {name: {**({"schedule": PLANTED_SCHEDULE} if name != "release" else {}),
                        **({"dp_sizes": planted_dp[name]} if name in planted_dp else {}),
                        **({"fused_decode": PLANTED_PATHS[name]} if name in PLANTED_PATHS else {}),
                        **({"decode_dp_sizes": PLANTED_DECODE_DP[name]} if name in PLANTED_DECODE_DP else {})} for name in targets}
    procs = {name: Started(textwrap.dedent(_CHECK.format(target=str(t), overrides=overrides[name]))) for name, t in targets.items()}
    out = {}
    for name, p in procs.items():
        proc = p.result(timeout=600)
        assert proc.returncode == 0, f"{name}: " + proc.stdout[-2000:] + proc.stderr[-3000:]
        out[name] = json.loads(proc.stdout)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    return _run_checks(VERSION, PLANTED, PLANTED_DP, tmp_path_factory.mktemp("vllm-planted"))


@pytest.fixture(scope="module")
def token_keyed(tmp_path_factory) -> dict[str, dict]:
    return _run_checks(TOKEN_KEYED, PLANTED_TOKEN_KEYED, PLANTED_TOKEN_KEYED_DP, tmp_path_factory.mktemp("vllm-planted-tok"))


def _failed(rep: dict) -> set[tuple[str, str, str]]:
    return {(f["check"], f["field"], f["where"].get("runner")) for ln in rep["lines"] for f in ln["failures"]}


@pytest.mark.engine
def test_release_passes_and_says_what_does_not_apply(results):
    rep, text = results["release"]["report"], results["release"]["text"]
    assert rep["version"] == VERSION
    assert rep["ok"], text
    runners = {(ln["runner"], ln["dp"]) for ln in rep["lines"]}
    assert runners == ({(r, dp) for r in ("target_verify", "draft_prefill", "draft_decode") for dp in (1, 2, 4)}
                       | {("draft_decode_fused", dp) for dp in (1, 2)})
    # every DP size replayed graphs in more than one bucket and ran eager above the verify-width cap
    buckets = {(ln["runner"], ln["dp"]): set() for ln in rep["lines"]}
    for ln in rep["lines"]:
        buckets[(ln["runner"], ln["dp"])].add(ln["bucket"])
    for (runner, dp), bs in buckets.items():
        assert len(bs - {"capture", "eager"}) >= 4, (runner, dp, bs)
        if not runner.startswith("draft_decode"):
            assert "eager" in bs, (runner, dp, bs)
    assert "verdict: PASS" in text
    for what in ("I2/I4/I5", "I3 ", "I6 ", "target_verify I1"):
        assert any(n.startswith(what) and "n/a" in n for n in rep["not_applicable"]), what
    # the stale padded input_ids / positions are reported as n/a with their lanes, not passed silently
    notes = [n for ln in rep["lines"] for n in ln["notes"]]
    assert any("n/a: padded-lane input_ids left stale" in n for n in notes)
    assert any("n/a: padded-lane positions left stale" in n for n in notes)
    assert "n/a: padded-lane input_ids" in text


@pytest.mark.engine
def test_planted_padded_tail_is_caught(results):
    rep = results["padded_tail_not_written"]["report"]
    assert not rep["ok"]
    failed = _failed(rep)
    # the kernels are the same on both decode paths: the fused graph's in-graph slot mappings too
    for runner in ("draft_decode", "draft_decode_fused"):
        for buffer in ("seq_lens", "slot_mapping"):
            assert ("padded tail", buffer, runner) in failed
            assert ("canonical", buffer, runner) in failed
    assert {r for _, _, r in failed} == {"draft_decode", "draft_decode_fused"}
    assert {b for c, b, _ in failed if c in ("padded tail", "canonical")} == {"seq_lens", "slot_mapping"}


@pytest.mark.engine
def test_release_drives_the_fused_decode_as_its_own_path(results):
    rep = results["release"]["report"]
    lines = {(ln["runner"], ln["dp"], ln["bucket"]): ln for ln in rep["lines"]}
    for dp in (1, 2):
        # the same draft decode grid on both paths (one decode manager), each line checked on its own
        assert lines[("draft_decode_fused", dp, "capture")]["captured_requests"] == lines[("draft_decode", dp, "capture")]["captured_requests"]
        assert lines[("draft_decode_fused", dp, "reqs=10 tokens=10")]["checked"] > 0
    # the fused world's target and draft prefill are the per-step world's: not reported twice
    assert sum(ln["runner"] == "target_verify" and ln["bucket"] == "capture" for ln in rep["lines"]) == 3


@pytest.mark.parametrize("planted, caught", [
    # the graph bakes steps 1 .. 3 where K - 1 = 2, and every replay runs them all
    ("fused_graph_extra_step", {("capture sizes", "draft steps in the graph"), ("steps", "draft steps run")}),
    # the replayed graph attends with metadata derived for another batch and writes KV through stale slot mappings
    ("fused_graph_skips_refresh", {("metadata", "seq_lens"), ("metadata", "query_start_loc"), ("lanes", "slot_mapping (real lanes)")}),
])
@pytest.mark.engine
def test_planted_fused_bug_is_caught_on_the_fused_path_only(results, planted, caught):
    rep = results[planted]["report"]
    assert not rep["ok"]
    failed = _failed(rep)
    assert {(c, f, "draft_decode_fused") for c, f in caught} <= failed
    assert {r for _, _, r in failed} == {"draft_decode_fused"}
    if planted == "fused_graph_extra_step":
        bad = [f for ln in rep["lines"] for f in ln["failures"] if f["field"] == "draft steps in the graph"]
        assert bad and all(f["expected"] == [1, 2] and f["got"] == [1, 2, 3] for f in bad)


@pytest.mark.parametrize("planted, runners, caught", [
    # step 2 reads step 1's position: its KV slot is step 1's too; seq_lens (advanced) and the metadata built from them agree
    ("next_step_positions_not_advanced", {"draft_decode", "draft_decode_fused"},
     {("lanes", "positions (real lanes)"), ("lanes", "slot_mapping (real lanes)")}),
    # step 2 runs on step 1's slot mappings and on metadata derived from step 1's seq_lens
    ("per_step_refresh_only_first", {"draft_decode"}, {("lanes", "slot_mapping (real lanes)"), ("metadata", "seq_lens")}),
    ("fused_refresh_only_first", {"draft_decode_fused"}, {("lanes", "slot_mapping (real lanes)"), ("metadata", "seq_lens")}),
])
@pytest.mark.engine
def test_planted_between_step_bug_is_caught_at_step_2_on_its_path(results, planted, runners, caught):
    rep = results[planted]["report"]
    assert not rep["ok"]
    fails = [f for ln in rep["lines"] for f in ln["failures"]]
    assert {(c, f, r) for c, f in caught for r in runners} <= _failed(rep)
    assert {f["where"]["runner"] for f in fails} == runners
    assert {f["where"]["step"] for f in fails} == {2}, "step 1 reads what _prepare_decode_inputs wrote: the bug is after it"
    if planted == "next_step_positions_not_advanced":
        assert {f["field"] for f in fails} == {"positions (real lanes)", "slot_mapping (real lanes)"}


@pytest.mark.engine
@pytest.mark.parametrize("release", ["results", "token_keyed"])
def test_planted_dp_pad_count_is_caught(release, request):
    rep = request.getfixturevalue(release)["dp_pads_to_own_count"]["report"]
    assert not rep["ok"]
    failed = _failed(rep)
    # the ranks run different graphs: the target's agreement, and the draft prefill that reuses it
    for runner in ("target_verify", "draft_prefill"):
        assert ("DP", "(mode, num_tokens) on every rank", runner) in failed
        assert ("padding", "graph (mode, requests)", runner) in failed
    assert all(f["where"]["dp"] > 1 for ln in rep["lines"] for f in ln["failures"])


@pytest.mark.engine
@pytest.mark.parametrize("release, planted", [("results", "capture_limit_ignores_query_len"), ("token_keyed", "rounded_size_ignores_cap")])
def test_planted_capture_limit_is_caught(release, planted, request):
    rep = request.getfixturevalue(release)[planted]["report"]
    assert not rep["ok"]
    failed = _failed(rep)
    for runner in ("target_verify", "draft_prefill"):
        assert ("capture sizes", "num_tokens <= cap", runner) in failed
        assert ("capture sizes", "request sizes at 1 + K", runner) in failed
    # one token per request: the cap alone bounds the draft decode graphs (0.34), and 64 requests exceed max_num_seqs (0.33)
    assert not any(r == "draft_decode" and c == "capture sizes" for c, _, r in failed)


@pytest.mark.engine
def test_token_keyed_release_passes_under_its_own_rules(token_keyed):
    rep, text = token_keyed["release"]["report"], token_keyed["release"]["text"]
    assert (rep["version"], rep["api"]) == (TOKEN_KEYED, "mrv2-tok")
    assert rep["ok"], text
    captured = {(ln["runner"], ln["dp"]): ln["captured_requests"] for ln in rep["lines"] if ln["bucket"] == "capture"}
    # cudagraph_capture_sizes 1, 2, 4, 8, 16, 24, 32, 48, 64 at 1 + K = 3 tokens per request: ceil(t / 3) requests
    # while within 64 tokens (64 itself would be 22 requests, 66 tokens: dropped); one-token draft decodes keep each
    # size up to max_num_seqs 24
    for dp in (1, 2, 4):
        assert captured[("target_verify", dp)] == captured[("draft_prefill", dp)] == [1, 2, 3, 6, 8, 11, 16]
        assert captured[("draft_decode", dp)] == [1, 2, 4, 8, 16, 24]
    buckets = {(ln["runner"], ln["bucket"]) for ln in rep["lines"] if ln["dp"] == 1}
    # 19 requests (57 tokens) are above the largest FULL graph (48 tokens) and run PIECEWISE at 64; 23 (69) run eager
    for runner in ("target_verify", "draft_prefill"):
        assert {(runner, "piecewise tokens=64"), (runner, "eager"), (runner, "reqs=16 tokens=48")} <= buckets
    assert ("draft_decode", "reqs=24 tokens=24") in buckets
    assert "verdict: PASS" in text and "cudagraph_capture_sizes=[1, 2, 4, 8, 16, 24, 32, 48, 64]" in text


def test_not_installed_is_exit_2(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECHARNESS_ENGINES", str(tmp_path))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert engine_check_main(parser.parse_args(["--engine", "vllm==0.0.1"])) == 2
    assert "vllm==0.0.1 is not installed" in capsys.readouterr().err
    assert engines_root() == tmp_path


def test_dp_world_all_reduce_sums_every_rank_and_raises_the_real_error():
    world = DPWorld(3)

    def vote(rank: int) -> list[int]:
        t = torch.zeros(2, 3, dtype=torch.int32)
        t[0][rank], t[1][rank] = 10 + rank, rank * rank
        world.group().cpu_all_reduce_(t)
        return t.tolist()

    assert world.run(vote) == [[[10, 11, 12], [0, 1, 4]]] * 3

    def fail_on_one(rank: int) -> None:
        if rank == 1:
            raise KeyError("rank 1")
        world.group().cpu_all_reduce_(torch.zeros(1))

    with pytest.raises(KeyError):
        world.run(fail_on_one)
    assert world.run(vote) == [[[10, 11, 12], [0, 1, 4]]] * 3  # usable again after a failed round


def test_dp_world_runs_one_rank_at_a_time_outside_its_collectives():
    """The ranks' engine code (Triton's interpreter among it) never runs on two threads at once; they meet only in a
    collective, where every rank's vote is in before any rank goes on."""
    world = DPWorld(3)
    running: list[int] = []
    overlaps: list[list[int]] = []
    votes_seen: list[list[int]] = []

    def rank_step(rank: int) -> None:
        for _ in range(2):
            running.append(rank)
            if len(running) > 1:
                overlaps.append(list(running))
            time.sleep(0.01)  # gives up the GIL: another rank would run here if nothing held it back
            running.remove(rank)
            t = torch.zeros(3, dtype=torch.int32)
            t[rank] = rank + 1
            world.group().cpu_all_reduce_(t)
            votes_seen.append(t.tolist())

    world.run(rank_step)
    assert overlaps == []
    assert votes_seen == [[1, 2, 3]] * 6


def test_dp_world_ranks_that_diverge_at_a_collective_raise_instead_of_hanging():
    world = DPWorld(2, meet_timeout_s=0.2)

    def only_rank_0_votes(rank: int) -> None:
        if rank == 0:
            world.group().cpu_all_reduce_(torch.zeros(1))

    with pytest.raises(EngineAdapterError, match="did not all reach the same collective"):
        world.run(only_rank_0_votes)



_MODEL_RUNNER = """
class GPUModelRunner:
    def __init__(self, vllm_config):
        self.num_speculative_steps = vllm_config.num_speculative_tokens

    def load_model(self):
        self.decode_query_len = {expr}
"""


def test_model_runner_query_length_is_its_own_assignment_evaluated(tmp_path):
    """Before VllmConfig.uniform_decode_query_len the target's query length is the model runner's assignment, evaluated
    over the configuration (its line is in the reason); an expression api.py cannot evaluate is an adapter error."""
    runner = tmp_path / "model_runner.py"
    runner.write_text(_MODEL_RUNNER.format(expr="self.num_speculative_steps + 1"))
    api = RunnerQueryLenApi(runner, "x")
    assert api.target_manager_kwargs(Strict("vllm_config", num_speculative_tokens=3)) == {"decode_query_len": 4}
    assert "model_runner.py:7: self.decode_query_len = self.num_speculative_steps + 1" in api.query_len_reason()
    runner.write_text(_MODEL_RUNNER.format(expr="max(self.num_speculative_steps, 1)"))
    with pytest.raises(EngineAdapterError, match=r"reads max\(self.num_speculative_steps, 1\)"):
        RunnerQueryLenApi(runner, "x").target_manager_kwargs(Strict("vllm_config", num_speculative_tokens=3))


@pytest.mark.parametrize("order,needed,want", [
    (DispatchOrder.FULL_FIRST, 4, ("FULL", 6)), (DispatchOrder.SMALLEST_GRAPH, 4, ("PIECEWISE", 16)),  # 12 tokens
    (DispatchOrder.FULL_FIRST, 2, ("FULL", 2)), (DispatchOrder.SMALLEST_GRAPH, 2, ("FULL", 2)),
    (DispatchOrder.FULL_FIRST, 9, ("PIECEWISE", 32)), (DispatchOrder.SMALLEST_GRAPH, 9, ("PIECEWISE", 32)),  # past every FULL graph
    (DispatchOrder.FULL_FIRST, 11, ("NONE", None)), (DispatchOrder.SMALLEST_GRAPH, 11, ("NONE", None)),  # 33 tokens: none holds it
    (DispatchOrder.SMALLEST_GRAPH, 6, ("FULL", 6)),  # 18 tokens: FULL and PIECEWISE both at 18, FULL first
])
def test_expected_graph_follows_the_release_dispatch_order(order, needed, want):
    """q = 3; FULL graphs of 2 and 6 requests (6 and 18 tokens); PIECEWISE at 8, 16, 18 and 32 tokens."""
    assert expected_graph(order, {6: 2, 18: 6}, [8, 16, 18, 32], needed, 3) == want
