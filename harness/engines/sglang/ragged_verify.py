"""SGLang's ragged verify graphs (the target's DecodeCudaGraphRunner in compact ragged-verify mode, 0.5.16 on).

With SGLANG_RAGGED_VERIFY_MODE=compact, for an algorithm whose verify may carry per-request
verify lengths (SpeculativeAlgorithm.supports_ragged_verify: DSpark, the DFlash family's block
drafter, in every release that has the mode), the target's verify graphs are keyed by a token
tier instead of a request bucket: the tiers are bs * T of every request bucket
(_build_ragged_verify_token_buckets), each captured with min(tier, max_bs) request slots and a
synthetic verify layout (verify_lens / qo_indptr) baked into the graph; a replay takes the tier
the verify planner chose (RaggedVerifyLayout.graph_num_tokens), the tier's slots, and stages the
live layout into the captured one, padded to the slots (_stage_ragged_verify_layout). The live
tokens arrive already packed and padded to the tier by the planner's verify window.

What runs is the engine's: DecodeCudaGraphRunner's __init__ in compact mode (the tiers, the
buffers, the registry), its capture() over every tier (capture_prepare with the tier's slots,
the DFlashVerifyInput get_spec_info bakes with the capture layout, the body's DP buffer) up to
the model call, and per replay can_run_graph and execute (load_batch: the tier, the slots, the
layout staging, the registry's replay fill) up to the graph launch; the verify layouts are the
DSpark planner's own functions (uniform_ragged_layout, the verify-all layout its default, flat SPS
table gives; and per-request verify lengths through verify_layout_graph_num_tokens_floor /
round_up_grid / RaggedVerifyLayout as schedule_layout builds them), the request count the tier is
keyed by as DSpark's worker passes it (dspark_worker_v2._forward_decode: the DP-global request
count only for a MoE draft, `global_num_reqs`; the dense draft driven here keys by its own).
Stood in: the model, the attention backend (it answers supports_ragged_verify_graph as the hybrid
linear-attention backends do), the graph; the planner's verify window is built here by its rule
(real tokens packed from row 0, the tier's tail with token 0, position 0, cache slot 0).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import types
import warnings
from typing import Any, Optional

import torch

from harness.engines.lanes import LaneRecord, LiveBatch, check_lanes, live_batch, schedule
from harness.engines.sglang.errors import EngineAdapterError
from harness.engines.sglang.graph import (
    FakeGraphBackend,
    ModelProbe,
    import_quietly,
    missing_api,
    prepare_runner_module,
    run_until_model,
    stop_at_model,
    tolist,
)
from harness.engines.sglang.handle import pruned_states
from harness.engines.sglang.standins import Strict, noop, patched
from harness.engines.sglang.target_verify import MODEL_RUNNER, as_target, run_capture
from harness.engines.sglang.target_verify import MODULE as DECODE_MODULE
from harness.props.p1_records import verify_capture_bs
from harness.verdict import Verdict
from runners.draft_extend import SEQ_LEN_FILL_VALUE
from runners.parallel.layout import ParallelLayout

KIND = "ragged_verify"
RV = "sglang.srt.speculative.ragged_verify"
PLANNER = "sglang.srt.speculative.dspark_components.dspark_planner"
DFLASH_INFO = "sglang.srt.speculative.dflash_info"
ALGORITHM = "DSPARK"
# the registry's padding policies for the request slots [raw_bs, slots): as for every decode graph
FILLED = frozenset({"seq_lens", "req_pool_indices"})
# DSpark's layouts (arg_groups/speculative_hook.py, _handle_dspark: DP attention requires --enable-dp-lm-head and the built-in TP MoE,
# moe_a2a_backend 'none', for the compact mode): one per branch
LAYOUTS: tuple[tuple[ParallelLayout, str], ...] = (
    (ParallelLayout(4, 2, True, None, True), "MLP-TP gather: DSpark's DP attention (dp lm head, no a2a backend)"),
    (ParallelLayout(4, 1, False, 1), "attn-TP gather"),
    (ParallelLayout(4), "neither"),
)
LAYOUT_SOURCES = ("verify-all", "scheduled")  # the planner's two compact layouts: uniform T per request, per-request lengths
NEVER = (
    f"{KIND}: driven on DSpark's own layouts (tp4-dp2-dp_lm_head, tp4-dense_tp1, tp4), whatever the run's: _handle_dspark rejects DP "
    "attention without --enable-dp-lm-head or with an a2a backend other than 'none' in compact mode, as the representative "
    "DP-attention layouts have",
    f"{KIND}: the Triton twins of the layout kernels (BuildQoIndptr / PaddedToBucket run `cls.triton if verify_lens.is_cuda else "
    "cls.torch`, ragged_verify_kernels.py): the CPU tensors here take the torch path; a GPU runs the Triton kernels, not run here",
    f"{KIND}: the DP-gathered verify tier of a MoE (DeepSeek-V4) DSpark draft (dspark_worker_v2._dp_verify_tier_num_tokens: "
    "a scheduler all-gather of every rank's tier) and the budget-driven dynamic tier without DP attention: not driven; the tier "
    "here is the pinned one (verify_layout_graph_num_tokens_floor with no tier hint) for the dense draft's request count",
)


@dataclasses.dataclass(frozen=True)
class Loaded:
    decode: types.ModuleType
    rv: types.ModuleType
    planner: types.ModuleType
    dflash_info: types.ModuleType
    model_runner_cls: type
    envs: Any


def load(engine: Any) -> tuple[Optional[Loaded], str]:
    if importlib.util.find_spec(RV) is None:
        return None, "the release ships no speculative/ragged_verify.py (the compact ragged verify graphs are in 0.5.16 on)"
    mods, why = import_quietly(DECODE_MODULE, RV, PLANNER, DFLASH_INFO, MODEL_RUNNER, "sglang.srt.environ")
    if mods is None:
        return None, why
    decode, rv, planner, info, mr, env = mods
    # _stage_ragged_verify_layout (the live layout refreshed into the captured one) is in 0.5.17 on; 0.5.16 has none (driven)
    missing = missing_api(decode.DecodeCudaGraphRunner, ("_capture_ragged_verify_layout", "_ragged_capture_slots", "execute"))
    missing += missing_api(planner, ("uniform_ragged_layout", "verify_layout_graph_num_tokens_floor"))
    if missing:
        return None, f"no {', '.join(missing)} (the compact ragged-verify API the adapter drives)"
    prepare_runner_module(decode, noop)
    return Loaded(decode, rv, planner, info, mr.ModelRunner, env.envs), ""


@dataclasses.dataclass
class TierCapture:
    """What one tier's capture baked."""

    tier: int
    slots: int
    num_tokens: int
    verify_lens: list[int]
    host_counts: Optional[list[int]]  # the body's set_dp_buffer_len counts
    dp_buffer_len: Optional[int]
    local_dp_buffer_len: Optional[int]
    gpu: Optional[list[int]]
    gpu_lp: Optional[list[int]]
    rows_fed: int
    logits_rows: int
    layout: Any  # the capture batch's RaggedVerifyLayout: its verify_lens / qo_indptr tensors are what the graph baked


@dataclasses.dataclass
class TierReplay:
    """What one replay launched: the tier and slots it chose, the buffers the graph reads, the staged layout."""

    tier: int
    slots: int
    gpu: Optional[list[int]]
    gpu_lp: Optional[list[int]]
    buffers: dict[str, Optional[list[int]]]
    staged_lens: list[int]
    staged_qo: list[int]
    seq_lens_sum: Optional[int]


class RaggedVerify:
    """One rank's target verify runner in compact ragged-verify mode: built on build.py's stand-ins, every tier captured."""

    def __init__(self, loaded: Loaded, runners: Any) -> None:
        self.loaded, self.engine, self.cfg, self.layout, self.tp_rank = loaded, runners.engine, runners.cfg, runners.layout, runners.tp_rank
        self.attn = attn = runners._attn()
        attn.supports_ragged_verify_graph = True  # as the hybrid linear-attention backends answer (the models DSpark drafts for)
        mr = runners._model_runner(runners.server_args, attn)
        as_target(mr, loaded.model_runner_cls)
        mr.spec_algorithm = self.engine.modules["spec_info"].SpeculativeAlgorithm.from_string(ALGORITHM)
        self.model_runner = mr
        self.mode = loaded.rv.RaggedVerifyMode.COMPACT
        decode = loaded.decode
        runner = object.__new__(decode.DecodeCudaGraphRunner)
        vars(runner)["capture"] = noop  # __init__ ends by capturing, before the adapter can stand in for the graph: run_capture below
        self.captures: dict[int, TierCapture] = {}
        self.last: Optional[TierReplay] = None
        with loaded.envs.SGLANG_RAGGED_VERIFY_MODE.override(self.mode.value):
            with patched(decode, "resolve_decode_backend", lambda r: None, self.engine.version, "the graph backend"):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    decode.DecodeCudaGraphRunner.__init__(runner, mr)
            del vars(runner)["capture"]
            if not runner.ragged_verify_mode:
                raise EngineAdapterError(f"sglang {self.engine.version}: the target's verify runner did not enter compact ragged-verify mode for {ALGORITHM}")
            self.runner = runner
            mr.decode_cuda_graph_runner = runner  # the planner reads the runner's tiers through the model runner
            runner.backend = FakeGraphBackend(self)  # keyed by tier: the graph key's size is the tier in this mode
            runner.deepep_adapter = Strict("deepep_adapter", capture=noop, replay=noop)
            runner.device_module = Strict("device_module", is_current_stream_capturing=lambda: False, Event=lambda: Strict("event", record=noop))
            if not isinstance(mr.model, ModelProbe):
                raise EngineAdapterError(f"sglang {self.engine.version}: the verify runner's model_runner is not the adapter's")
            mr.model.handle = self
            run_capture(self.engine, self.layout, self.tp_rank, decode, runner)
        for tier in self.tiers:
            if tier not in self.captures:
                raise EngineAdapterError(f"sglang {self.engine.version}: capturing tier {tier} of the ragged verify graphs recorded nothing")

    @property
    def T(self) -> int:
        return int(self.runner.captured_req_width)

    @property
    def tiers(self) -> list[int]:
        return [int(t) for t in self.runner.capture_num_tokens]

    # ---- capture ----
    def on_model_forward(self, fb: Any) -> Any:
        stop_at_model(fb, self.runner.buffers, f"sglang {self.engine.version}: the ragged verify capture body")

    def run_body_until_model(self, tier: int, run_once: Any) -> None:
        fb, dp, gpu, gpu_lp = run_until_model(run_once, f"sglang {self.engine.version}: the ragged verify capture body for tier {tier}")
        lay = getattr(fb.spec_info, "ragged_verify_layout", None)
        if lay is None:
            raise EngineAdapterError(f"sglang {self.engine.version}: tier {tier}'s capture batch carries no ragged verify layout")
        n = int(fb.input_ids.shape[0])
        nt = dp.get("global_num_tokens")
        self.captures[tier] = TierCapture(
            tier, int(fb.batch_size), n, tolist(lay.verify_lens) or [], None if nt is None else [int(x) for x in nt],
            dp.get("global_dp_buffer_len"), dp.get("local_dp_buffer_len"), gpu, gpu_lp,
            int(pruned_states(self.engine, fb, torch.zeros(n, 1)).shape[0]), int(fb.next_token_logits_buffer.shape[0]), lay)

    def fake_output(self, tier: int) -> Any:
        """The verify graph's output: a logits row per token of the tier."""
        lpo = self.engine.modules["logits"].LogitsProcessorOutput
        return lpo(next_token_logits=torch.zeros(tier, self.cfg.vocab_size), hidden_states=torch.zeros(tier, 1))

    # ---- replay ----
    def on_replay(self, tier: int) -> None:
        b, cap = self.runner.buffers, self.captures[tier].layout if tier in self.captures else None
        view = self.attn.last_replay_view
        self.last = TierReplay(tier, int(self.runner.bs), tolist(b.global_num_tokens_gpu), tolist(b.global_num_tokens_for_logprob_gpu),
                               {n: tolist(getattr(b, n)) for n in ("req_pool_indices", "seq_lens", "input_ids", "positions", "out_cache_loc")},
                               tolist(cap.verify_lens) if cap is not None else [], tolist(cap.qo_indptr_device) if cap is not None else [],
                               None if view is None else int(view.seq_lens_sum))

    def layout_for(self, lens: list[int], tier_num_reqs: Optional[int], source: str) -> Any:
        """The planner's layout for these verify lengths: verify-all (uniform_ragged_layout) or scheduled (schedule_layout's
        pinned-tier path: the floor from the request count, the captured grid, the live lengths on the device)."""
        p, T, mr = self.loaded.planner, self.T, self.model_runner
        if source == "verify-all":
            lay = p.uniform_ragged_layout(bs=len(lens), device=torch.device("cpu"), verify_num_draft_tokens=T, ragged_verify_mode=self.mode,
                                          model_runner=mr, tier_num_reqs=tier_num_reqs)
            if lay is None:
                raise EngineAdapterError(f"sglang {self.engine.version}: the planner gave no verify-all layout for {len(lens)} requests")
            return lay
        floor = p.verify_layout_graph_num_tokens_floor(num_reqs=len(lens) if tier_num_reqs is None else tier_num_reqs,
                                                       ragged_verify_mode=self.mode, verify_num_draft_tokens=T, model_runner=mr)
        tier = self.loaded.rv.round_up_grid(floor, self.tiers)
        return self.loaded.rv.RaggedVerifyLayout.from_verify_lens_device(verify_lens=torch.tensor(lens, dtype=torch.int32), graph_num_tokens=tier)

    def forward_batch(self, live: LiveBatch, lens: list[int], lay: Any) -> tuple[Any, dict[str, list[int]]]:
        """The verify batch DSpark hands the target: the packed window of every request's verify tokens, padded to the tier."""
        fbi, tier = self.engine.modules["fbi"], int(lay.graph_num_tokens)
        total = sum(lens)
        tok = live.tokens(self.T)
        per_req_rows = [i * self.T + j for i, n in enumerate(lens) for j in range(n)]  # request i's first n tokens of its window
        window = {k: [v[r] for r in per_req_rows] + [0] * (tier - total) for k, v in tok.items()}
        t = {k: torch.tensor(v, dtype=torch.int64) for k, v in window.items()}
        seq_lens = torch.tensor(live.seq_lens, dtype=torch.int64)
        spec = self.loaded.dflash_info.DFlashVerifyInput(draft_token=t["input_ids"], positions=t["positions"], draft_token_num=self.T,
                                                         custom_mask=None, capture_hidden_mode=fbi.CaptureHiddenMode.FULL,
                                                         ragged_verify_layout=lay)
        fb = fbi.ForwardBatch(forward_mode=fbi.ForwardMode.TARGET_VERIFY, batch_size=live.raw_bs, input_ids=t["input_ids"],
                              req_pool_indices=torch.tensor(live.req_pool_indices, dtype=torch.int64), seq_lens=seq_lens,
                              out_cache_loc=t["out_cache_loc"], seq_lens_sum=int(seq_lens.sum()))
        dp_sizes = list(live.dp_batch_sizes)
        for key, val in dict(seq_lens_cpu=seq_lens.clone(), positions=t["positions"], spec_info=spec,
                             capture_hidden_mode=fbi.CaptureHiddenMode.FULL, original_global_num_tokens_cpu=dp_sizes,
                             global_num_tokens_cpu=dp_sizes, global_num_tokens_for_logprob_cpu=dp_sizes,
                             can_run_dp_cuda_graph=True, can_run_decode_cuda_graph=True).items():
            setattr(fb, key, val)
        return fb, window

    def replay(self, live: LiveBatch, lens: list[int], tier_num_reqs: Optional[int], source: str) -> tuple[TierReplay, Any, dict, int]:
        lay = self.layout_for(lens, tier_num_reqs, source)
        fb, window = self.forward_batch(live, lens, lay)
        r = self.runner
        if not r.can_run_graph(fb):
            raise EngineAdapterError(f"sglang {self.engine.version}: the ragged verify runner refused {live.raw_bs} requests at tier "
                                     f"{lay.graph_num_tokens} (can_run_graph)")
        self.last, self.attn.last_replay_view = None, None
        out = r.execute(fb)
        if self.last is None:
            raise EngineAdapterError(f"sglang {self.engine.version}: the ragged verify replay never reached the graph")
        if not r.require_gathered_buffer:  # allocated in every branch, unfilled and unread without a gathered buffer
            self.last.gpu = self.last.gpu_lp = None
        return self.last, lay, window, int(out.next_token_logits.shape[0])


def layouts(run_layouts: tuple[ParallelLayout, ...]) -> tuple[tuple[ParallelLayout, str], ...]:
    """Fixed, whatever the run's layouts (the module doc says why)."""
    return LAYOUTS


def verify_lens(live: LiveBatch, T: int, source: str) -> list[int]:
    """Each request's verify length: T (verify-all), or 1..T per request, varying with the iteration (scheduled: a request
    always verifies its anchor)."""
    return [T] * live.raw_bs if source == "verify-all" else [1 + (i + live.iteration) % T for i in range(live.raw_bs)]


def check(rv: RaggedVerify, layout: ParallelLayout, d: int, tp_rank: int, line, per_request: dict, shared: dict) -> None:
    """Every tier's capture, then both layout sources over the schedule: the tier and slots each replay takes, the replay
    fill against the capture (I1) and the rows it feeds lm_head (I2), the staged layout, the real and padded lanes; each
    replay's tier kept in `shared` for the DP check across the layout's DP groups (finish)."""
    T, cfg = rv.T, rv.cfg
    dp = layout.attn_dp_size if layout.require_mlp_tp_gather else 1
    base = {"layout": layout.describe(), "branch": layout.branch.value, "runner": KIND, "step": 0, "rank": tp_rank}
    expected_tiers = [b * T for b in verify_capture_bs(layout, cfg.capture_bs, cfg.max_running_requests, T)]
    for tier, cap in rv.captures.items():
        v = line(KIND, 0, tier).verdict
        _check_capture(v, {**base, "bs": tier}, layout, cap, T, expected_tiers, rv.runner.max_bs, dp)
    for source in LAYOUT_SOURCES:
        seen: dict = {}
        for it, dp_sizes in enumerate(schedule(layout, [t // T for t in rv.tiers])):
            raw = dp_sizes[d]
            live = live_batch(raw, dp_sizes, it, T, cfg.max_running_requests)
            lens = verify_lens(live, T, source)
            got, lay, window, returned = rv.replay(live, lens, None, source)  # the dense draft keys the tier by its own requests
            ln = line(KIND, 0, got.tier)
            ln.raw_bs.add(raw)
            ln.ranks.add(tp_rank)
            ln.tokens_per_bs = T
            w = {**base, "layout_source": source, "iteration": it, "raw_bs": raw, "bs": got.tier}
            _check_replay(ln.verdict, w, layout, rv, got, lens, window, returned, dp)
            check_lanes(ln.verdict, LaneRecord(KIND, 0, "", raw, got.slots, T, {n: got.buffers[n] for n in FILLED}), live, seen, w, FILLED)
            shared.setdefault((source, it), {})[d] = (got.tier, got.gpu, tp_rank, w)


def _check_capture(v: Verdict, w: dict, layout: ParallelLayout, cap: TierCapture, T: int, expected_tiers: list[int], max_bs: int, dp: int) -> None:
    v.expect_equal("padding", "capture tiers", w, True, cap.tier in expected_tiers,
                   f"a tier is bs * T of a request bucket the target captures ({expected_tiers})")
    v.expect_equal("padding", "capture num_tokens", w, cap.tier, cap.num_tokens, "the tier's graph runs the tier's tokens")
    v.expect_equal("capture", "slots", w, True, cap.slots * T >= cap.tier and cap.slots <= max_bs,
                   f"the tier's request slots ({cap.slots}) hold its tokens at most T = {T} each, within the buffers' {max_bs}")
    v.expect_equal("capture", "verify_lens", w, (cap.slots, cap.tier), (len(cap.verify_lens), sum(cap.verify_lens)),
                   "the baked layout: one verify length per slot, the tier's tokens in all")
    v.expect_equal("capture", "verify_lens range", w, True, all(1 <= x <= T for x in cap.verify_lens),
                   f"every slot verifies its anchor and at most T = {T} tokens: {cap.verify_lens}")
    v.expect_equal("I2", "rows fed to lm_head (capture)", w, cap.tier, cap.rows_fed, "TARGET_VERIFY computes logits for every token")
    v.expect_equal("I2", "logits rows (capture)", w, cap.tier, cap.logits_rows, "the logits buffer the graph writes")
    v.expect_equal("padding", "local_dp_buffer_len", w, cap.tier, cap.local_dp_buffer_len, "the body's DP buffer holds the tier's tokens")
    if not layout.require_gathered_buffer:
        v.expect_equal("padding", "global_num_tokens_cpu", w, None, cap.host_counts, "no gathered buffer in this branch")
        return
    counts = [cap.tier] * dp
    v.expect_equal("capture", "global_num_tokens_cpu", w, counts, cap.host_counts, "every DP group padded to the tier")
    v.expect_equal("capture", "global_num_tokens_gpu", w, counts, cap.gpu)
    v.expect_equal("I2", "global_num_tokens_for_logprob_gpu (capture)", w, counts, cap.gpu_lp, "every token a logits row")
    v.expect_equal("I4", "global_dp_buffer_len", w, sum(counts), cap.dp_buffer_len, "Σ for_logprob = gathered rows")


def _check_replay(v: Verdict, w: dict, layout: ParallelLayout, rv: RaggedVerify, got: TierReplay, lens: list[int], window: dict,
                  returned: int, dp: int) -> None:
    raw, T, total = len(lens), rv.T, sum(lens)
    floor = raw * T  # the pinned tier's floor: the request count at the full verify width (verify_layout_graph_num_tokens_floor)
    v.expect_equal("padding", "tier", w, min(t for t in rv.tiers if t >= floor), got.tier, f"the smallest captured tier >= {floor} tokens")
    v.expect_equal("padding", "tier >= verify tokens", w, True, got.tier >= total, f"{total} live verify tokens")
    v.expect_equal("padding", "slots >= raw_bs", w, True, got.slots >= raw)
    cap = rv.captures.get(got.tier)
    v.expect_equal("padding", "slots", w, None if cap is None else cap.slots, got.slots, "the tier's captured slots")
    v.expect_equal("padding", "returned logits rows", w, got.tier, returned, "the tier's packed rows (the worker keeps the live ones)")
    padded = got.buffers["seq_lens"][raw:got.slots]
    v.expect_equal("padding", "padded seq_lens", w, [SEQ_LEN_FILL_VALUE] * (got.slots - raw), padded)
    v.expect_equal("padding", "seq_lens_sum", w, sum(got.buffers["seq_lens"][:got.slots]), got.seq_lens_sum, "metadata sum vs the buffer's lanes")
    # the staged layout (the tensors the graph baked, refreshed in place): the real requests' rows start where the packed tokens do
    v.expect_equal("replay", "qo_indptr real rows", w, [sum(lens[:i]) for i in range(raw)], got.staged_qo[:raw],
                   "the staged layout: request i's tokens start at Σ lens[:i]")
    # without padding rows the last real row absorbs the tier's leftover tokens, up to T (padded_to_bucket with cap=T): its own
    # tokens still come first; every other real row keeps its length
    keep = raw - 1 if raw == got.slots else raw
    v.expect_equal("replay", "verify_lens real rows", w, lens[:keep], got.staged_lens[:keep], "the staged layout keeps each real request's verify length")
    if keep < raw:
        v.expect_equal("replay", "verify_lens last real row", w, True, lens[-1] <= got.staged_lens[raw - 1] <= T,
                       f"with no padding row the last request keeps its {lens[-1]} tokens first and may grow to T = {T}: {got.staged_lens[raw - 1]}")
    v.expect_equal("replay", "verify_lens range", w, True, all(0 <= x <= T for x in got.staged_lens) and sum(got.staged_lens) <= got.tier,
                   f"staged lengths within [0, T = {T}] and within the tier: {got.staged_lens}")
    for name in ("input_ids", "positions", "out_cache_loc"):
        v.expect_equal("lanes", name, w, window[name], got.buffers[name][:got.tier], "the tier's packed window, as the replay fill copies it")
    if not layout.require_gathered_buffer:
        v.expect_equal("padding", "global_num_tokens_gpu", w, None, got.gpu, "no gathered buffer in this branch")
        return
    v.expect_equal("fill", "global_num_tokens_gpu (replay fill)", w, [got.tier] * dp, got.gpu)
    v.expect_equal("fill", "global_num_tokens_for_logprob_gpu (replay fill)", w, [got.tier] * dp, got.gpu_lp)
    if cap is not None:
        v.expect_equal("I1", "global_num_tokens_gpu", w, got.gpu, cap.gpu, "baked at capture vs replay fill")
        v.expect_equal("I1", "global_num_tokens_for_logprob_gpu", w, got.gpu_lp, cap.gpu_lp, "baked at capture vs replay fill")


def finish(layout: ParallelLayout, shared: dict, line) -> None:
    """Per-DP-rank token counts: in the MLP-TP branch every DP group's replay fill tells the gather each group launches its own
    tier, so the groups of one iteration must launch one tier (the one every fill holds)."""
    if not layout.require_mlp_tp_gather:
        return
    for (_source, _it), groups in shared.items():
        tiers = {d: g[0] for d, g in groups.items()}
        agreed = max(tiers.values())
        for tier, gpu, _rank, w in groups.values():
            v = line(KIND, 0, tier).verdict
            v.expect_equal("DP", "global_num_tokens_gpu (every DP group's tier)", {**w, "dp_tiers": [tiers[g] for g in sorted(tiers)]},
                           [tiers[g] for g in sorted(tiers)], gpu,
                           "the tokens each DP group launches, which this group's fill tells the MLP gather; a group whose fill "
                           f"differs sizes the gather for tokens another group does not send (largest tier {agreed})")
