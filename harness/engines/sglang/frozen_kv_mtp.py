"""SGLang's Frozen-KV MTP draft graphs (FrozenKVMTPCudaGraphRunner), driven up to the model call.

Frozen-KV MTP (a Gemma-4 assistant draft promoted from EAGLE / NEXTN) reads the target's KV
cache and owns none: its draft loop -- a seed forward on (bonus token, target hidden state),
then num_steps - 1 recurrent steps -- is one DECODE graph per request bucket. With topk > 1 the
worker expands the batch before the graph (frozen_kv_mtp_utils.expand_for_topk_draft): every
request becomes topk rows of req_pool_indices / seq_lens / positions, so the graph's batch is
bs * topk rows, one token each, every one a logits row.

What runs is the engine's: the runner's __init__ (get_batch_sizes_to_capture at width topk, the
static buffers), DecodeCudaGraphRunner's capture() over every bucket through the runner's own
capture_one_shape (its forward batch, the gathered gpu tensors, the DP buffer its body sets) up
to the model call, inside the worker's own draft_forward (bound to the stand-in worker, like the
worker's metadata helpers); per replay the worker's expansion (the release's
expand_for_topk_draft / set_frozen_kv_positions on the raw batch), the DP counts as the worker's
ForwardBatch carries them (the scheduler's per-rank request counts scaled by the release's own
rule: spec_scale_global_num_tokens, or get_spec_adjusted_global_num_tokens before 0.5.16), then
can_run_graph and execute (the bucket, the replay fill) up to the graph launch, where the static
buffers are snapshotted. Stood in: the draft model (its forward stops the body), the attention
backend (handle.py's recorder), the KV pools (never read: no model runs), the graph.

Releases: the file exists from 0.5.12; 0.5.12 - 0.5.13.post1 carry it on the CudaGraphRunner-era
API (capture_one_batch_size / replay, no execute): `load()` says n/a.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import importlib.util
import types
import warnings
from typing import Any, Optional

import torch

from harness.engines.lanes import LaneRecord, LiveBatch, check_lanes, live_batch, schedule
from harness.engines.record_checks import check_captures
from harness.engines.sglang.errors import EngineAdapterError
from harness.engines.sglang.graph import (
    FakeGraphBackend,
    import_quietly,
    missing_api,
    prepare_runner_module,
    run_until_model,
    stop_at_model,
    tolist,
)
from harness.engines.sglang.handle import RunnerFacts, pruned_states
from harness.engines.sglang.standins import Strict, noop, patched
from harness.engines.sglang.target_verify import MODULE as DECODE_MODULE
from harness.engines.sglang.target_verify import run_capture
from harness.props.p1_records import check_replay_record, verify_capture_bs
from harness.run.records import CaptureRecord, ReplayRecord
from runners.draft_extend import SEQ_LEN_FILL_VALUE
from runners.parallel.layout import ParallelLayout

KIND = "frozen_kv_mtp"
MODULE = "sglang.srt.speculative.frozen_kv_mtp_cuda_graph_runner"
WORKER = "sglang.srt.speculative.frozen_kv_mtp_worker_v2"
UTILS = "sglang.srt.speculative.frozen_kv_mtp_utils"
# the worker's own methods the runner and the draft loop call, bound to the stand-in worker
WORKER_METHODS = ("_frozen_kv_target_view", "_target_kv_pool_view", "_set_positions", "_init_frozen_kv_metadata",
                  "_init_frozen_kv_metadata_capture_cuda_graph", "_init_frozen_kv_metadata_replay_cuda_graph", "draft_forward")
# the buffers whose padded rows execute() resets whenever it pads (`if bs != raw_bs`: seq_lens to the fill value, positions and
# req_pool_indices zeroed; frozen_kv_mtp_cuda_graph_runner.py, execute); all three are bs * topk rows (expanded)
FILLED = frozenset({"seq_lens", "positions", "req_pool_indices"})
LANES = ("req_pool_indices", "seq_lens", "positions")
# what execute() copies for the real requests only: the padded requests' seeds are the last larger batch's (their drafts are
# sliced off by _postprocess_output_to_raw_bs)
SEED_NOT_CHECKED = (f"{KIND}: the padded request rows of bonus_tokens / hidden_states (the seed forward's inputs): not checked: execute() "
                    "copies the real requests' rows only, so a padded request seeds from the last larger batch's; its drafts are "
                    "dropped by _postprocess_output_to_raw_bs, and no lane check is written for a seed")


@dataclasses.dataclass(frozen=True)
class Loaded:
    mod: types.ModuleType
    worker_cls: type
    utils: types.ModuleType
    spec_info: types.ModuleType


def load(engine: Any) -> tuple[Optional[Loaded], str]:
    """The runner module, the worker class and the worker's helpers, or None with the reason the runner is not driven."""
    if importlib.util.find_spec(MODULE) is None:
        return None, "the release ships no speculative/frozen_kv_mtp_cuda_graph_runner.py (it is in 0.5.12 on)"
    mods, why = import_quietly(MODULE)
    if mods is None:
        return None, why
    mod = mods[0]
    missing = missing_api(getattr(mod, "FrozenKVMTPCudaGraphRunner", None), ("execute", "capture_one_shape", "can_run_graph"))
    if missing:  # read before the worker is imported: 0.5.12's imports sgl_kernel unconditionally
        return None, (f"its FrozenKVMTPCudaGraphRunner has no {', '.join(missing)}: the CudaGraphRunner-era API "
                      "(capture_one_batch_size / replay, 0.5.12 - 0.5.13.post1), which the adapter does not drive")
    mods, why = import_quietly(WORKER, UTILS, "sglang.srt.speculative.spec_info")
    if mods is None:
        return None, why
    worker, utils, spec_info = mods
    worker_cls = getattr(worker, "FrozenKVMTPDraftWorker", None)
    absent = missing_api(worker_cls, WORKER_METHODS)
    if absent:
        return None, f"its FrozenKVMTPDraftWorker has no {', '.join(absent)} (the worker helpers the runner calls moved)"
    prepare_runner_module(mod, noop)
    return Loaded(mod, worker_cls, utils, spec_info), ""


@dataclasses.dataclass
class ExpandedBatch(LiveBatch):
    """The live batch as the frozen graph reads it: each request's rows repeated topk times (one token each), and the
    position the worker gives every row: the last written target slot, seq_len - 1 (set_frozen_kv_positions)."""

    def tokens(self, T: int) -> dict[str, list[int]]:
        return {"positions": [max(s - 1, 0) for s in self.seq_lens]}


def expanded(live: LiveBatch, k: int) -> ExpandedBatch:
    def rep(xs: list[int]) -> list[int]:
        return [x for x in xs for _ in range(k)]
    return ExpandedBatch(live.raw_bs * k, [b * k for b in live.dp_batch_sizes], rep(live.seq_lens), rep(live.accept_lens),
                         rep(live.req_pool_indices), live.iteration)


def padded_request_seq_lens(seq_lens: list[int], raw_bs: int, bs: int, k: int) -> list[int]:
    """seq_lens of the padded requests [raw_bs, bs), each from its k rows: the fill value where all its rows hold it, else
    the first of its rows that does not (so a padded request passes the fill-value check only if every row of it does)."""
    out = []
    for r in range(raw_bs, bs):
        rows = seq_lens[r * k:(r + 1) * k]
        out.append(next((x for x in rows if x != SEQ_LEN_FILL_VALUE), SEQ_LEN_FILL_VALUE))
    return out


class FrozenKVMTP(RunnerFacts):
    """One rank's FrozenKVMTPCudaGraphRunner: built on build.py's stand-ins, captured per bucket, replayed."""

    def __init__(self, loaded: Loaded, runners: Any) -> None:
        self.loaded, self.engine, self.cfg, self.layout, self.tp_rank = loaded, runners.engine, runners.cfg, runners.layout, runners.tp_rank
        self.k = k = self.cfg.draft_decode_topk  # at topk 1 rows and requests are the same number: a mix-up would pass
        self.kind, self.step = KIND, 0
        self.captures: dict[int, CaptureRecord] = {}
        self.capture_rows: dict[int, tuple[int, int]] = {}
        self._snap: Optional[dict] = None
        self.attn = attn = runners._attn()
        attn.token_to_kv_pool = Strict("the draft backend's token_to_kv_pool")  # swapped for the target's around every plan
        replace = getattr(runners.server_args, "replace_resolved", None)  # 0.5.19: a resolved ServerArgs is read-only
        if replace is not None:
            sa = replace("engine-check: the frozen draft's top-k", speculative_eagle_topk=k)
        else:
            sa = copy.copy(runners.server_args)
            sa.speculative_eagle_topk = k
        mr = runners._model_runner(sa, attn)
        mr.spec_algorithm = self.engine.modules["spec_info"].SpeculativeAlgorithm.from_string("FROZEN_KV_MTP")
        mr.is_draft_worker = True
        vars(mr)["forward"] = self._model_forward  # the draft model: stops the capture body at its call
        worker = Strict("frozen_kv_mtp_worker", draft_model_runner=mr, draft_attn_backend=attn, topk=k, _recurrent_hidden_size=self.cfg.hidden_size,
                        speculative_num_steps=self.cfg.num_steps, speculative_num_draft_tokens=self.cfg.num_draft_tokens,
                        kv_context=Strict("kv_context", target_token_to_kv_pool=Strict("the target's token_to_kv_pool")))
        for name in WORKER_METHODS:
            setattr(worker, name, types.MethodType(getattr(loaded.worker_cls, name), worker))
        mod = loaded.mod
        Runner = mod.FrozenKVMTPCudaGraphRunner
        runner = object.__new__(Runner)
        vars(runner)["capture"] = noop  # __init__ ends by capturing, before the adapter can stand in for the graph: run_capture below
        rc = self.engine.modules.get("runtime_context")
        spec = getattr(rc, "get_spec", None)
        with patched(mod, "resolve_decode_backend", lambda r: None, self.engine.version, "the graph backend"):
            with warnings.catch_warnings(), (spec().override(speculative_eagle_topk=k) if spec is not None else contextlib.nullcontext()):
                warnings.simplefilter("ignore")
                Runner.__init__(runner, worker)
        del vars(runner)["capture"]
        runner.backend = FakeGraphBackend(self)
        runner.deepep_adapter = Strict("deepep_adapter", capture=noop, replay=noop)  # the MoE dispatch mode switch (DeepEP)
        runner.device_module = Strict("device_module", is_current_stream_capturing=lambda: False, Event=lambda: Strict("event", record=noop))
        self.runner = runner
        run_capture(self.engine, self.layout, self.tp_rank, importlib.import_module(DECODE_MODULE), runner)
        for bs in self.capture_bs:
            if bs not in self.captures:
                raise EngineAdapterError(f"sglang {self.engine.version}: capturing bucket {bs} of the frozen-KV MTP runner recorded nothing")

    # ---- capture ----
    def _model_forward(self, fb: Any, *args: Any, **kwargs: Any) -> Any:
        stop_at_model(fb, self.runner.buffers, f"sglang {self.engine.version}: the frozen-KV MTP draft loop (draft_forward)")

    def run_body_until_model(self, bs: int, run_once: Any) -> None:
        fb, dp, gpu_tokens, gpu_logprob = run_until_model(run_once, f"sglang {self.engine.version}: the frozen-KV MTP capture body for bucket {bs}")
        n = int(fb.input_ids.shape[0])  # the seed forward's tokens: the bonus tokens repeated topk times
        nt = dp.get("global_num_tokens")
        host = {
            "forward_mode": getattr(fb.forward_mode, "name", str(fb.forward_mode)).lower(),
            "batch_size": int(fb.batch_size),
            "num_tokens": n,
            "extend_num_tokens": None,
            "global_num_tokens_cpu": None if nt is None else [int(x) for x in nt],
            "global_num_tokens_for_logprob_cpu": None,  # the runner bakes the gpu tensor only
            "global_dp_buffer_len": dp.get("global_dp_buffer_len"),
            "dp_padding_mode": "max_len" if dp.get("dp_max_padding") else "sum_len",
            "fb_global_num_tokens_cpu": None if fb.global_num_tokens_cpu is None else [int(x) for x in fb.global_num_tokens_cpu],
            "fb_global_dp_buffer_len": fb.global_dp_buffer_len,
            "local_dp_buffer_len": dp.get("local_dp_buffer_len"),
        }
        self.captures[bs] = CaptureRecord(bs, n, host, gpu_tokens, gpu_logprob)
        rows = int(pruned_states(self.engine, fb, torch.zeros(n, 1)).shape[0])
        # the batch carries no logits buffer (the processor allocates its own): the logits rows are the rows fed to lm_head
        self.capture_rows[bs] = (rows, rows)

    def fake_output(self, bs: int) -> tuple:
        """The draft loop's outputs (organize_draft_results): parent list, top-score indices, draft tokens, one row per request."""
        d = self.cfg.num_draft_tokens - 1
        return (torch.zeros(bs, 1 + self.k * max(self.cfg.num_steps - 1, 0), dtype=torch.int64), torch.zeros(bs, d, dtype=torch.int64),
                torch.zeros(bs, d, dtype=torch.int64))

    # ---- replay ----
    def on_replay(self, bs: int) -> None:
        b = self.runner.buffers
        g = b.global_num_tokens_gpu
        self._snap = {"bs": bs, "gpu": tolist(g), "lp": tolist(b.global_num_tokens_for_logprob_gpu), "shape": None if g is None else tuple(g.shape),
                      "lanes": {n: tolist(getattr(b, n)) for n in LANES}}

    def _forward_batch(self, live: LiveBatch) -> Any:
        """The batch the worker's draft() hands the runner: a DECODE ForwardBatch over the raw requests, its positions and the
        topk expansion by the release's own helpers, the DP counts scaled from the scheduler's request counts as
        ForwardBatch.init_new scales them (by the spec input's widths, topk tokens per request)."""
        fbi, u = self.engine.modules["fbi"], self.loaded.utils
        k, raw = self.k, live.raw_bs
        seq_lens = torch.tensor(live.seq_lens, dtype=torch.int64)
        spec = self.loaded.mod.FrozenKVMTPDraftInput(
            topk_p=torch.zeros(raw, k), topk_index=torch.zeros(raw, k, dtype=torch.int64), hidden_states=torch.zeros(raw, self.cfg.hidden_size),
            bonus_tokens=torch.arange(3, 3 + raw, dtype=torch.int64), capture_hidden_mode=fbi.CaptureHiddenMode.LAST)
        spec.num_tokens_per_req = k  # the draft forward's width, as draft() sets it before the batch is built
        spec.num_tokens_for_logprob_per_req = k
        fb = fbi.ForwardBatch(forward_mode=fbi.ForwardMode.DECODE, batch_size=raw, input_ids=None,
                              req_pool_indices=torch.tensor(live.req_pool_indices, dtype=torch.int64), seq_lens=seq_lens,
                              out_cache_loc=None, seq_lens_sum=int(seq_lens.sum()))
        counts = list(live.dp_batch_sizes)  # the scheduler's sync: request counts on a decode round
        scaled, scaled_lp = self._scale(spec, counts)
        for key, val in dict(seq_lens_cpu=seq_lens.clone(), positions=None, spec_info=spec, original_global_num_tokens_cpu=counts,
                             global_num_tokens_cpu=scaled, global_num_tokens_for_logprob_cpu=scaled_lp, can_run_dp_cuda_graph=True,
                             can_run_decode_cuda_graph=True, capture_hidden_mode=fbi.CaptureHiddenMode.LAST).items():
            setattr(fb, key, val)
        u.set_frozen_kv_positions(fb, k)
        u.expand_for_topk_draft(fb, k)
        return fb

    def _scale(self, spec: Any, counts: list[int]) -> tuple[list[int], list[int]]:
        scale = getattr(self.loaded.spec_info, "spec_scale_global_num_tokens", None)
        if scale is not None:
            return scale(spec, counts, counts)
        adjust = getattr(spec, "get_spec_adjusted_global_num_tokens", None)
        if adjust is None:
            raise EngineAdapterError(f"sglang {self.engine.version}: neither spec_scale_global_num_tokens nor get_spec_adjusted_global_num_tokens "
                                     "(how ForwardBatch.init_new scales the DP counts) is where the adapter looks")
        return adjust(types.SimpleNamespace(global_num_tokens=counts, global_num_tokens_for_logprob=counts))

    def replay(self, live: LiveBatch) -> tuple[ReplayRecord, int, LaneRecord, ExpandedBatch]:
        """One draft-loop replay of the live batch, as the worker drives it: can_run_graph, then execute up to the launch."""
        fb = self._forward_batch(live)
        if not self.runner.can_run_graph(fb):
            raise EngineAdapterError(f"sglang {self.engine.version}: the frozen-KV MTP runner refused a batch of {live.raw_bs} (can_run_graph)")
        self._snap, self.attn.last_replay_view = None, None
        out = self.runner.execute(fb)
        s = self._snap
        if s is None:
            raise EngineAdapterError(f"sglang {self.engine.version}: the frozen-KV MTP replay never reached the graph")
        cap = self.captures.get(s["bs"])
        if cap is None:
            raise EngineAdapterError(f"sglang {self.engine.version}: frozen-KV MTP replay chose bucket {s['bs']}, never captured")
        view, k, bs = self.attn.last_replay_view, self.k, s["bs"]
        n = bs * k
        seq_lens = s["lanes"]["seq_lens"]
        rec = ReplayRecord(
            runner=KIND, step=0, branch=self.layout.branch.value, raw_bs=live.raw_bs, bs=bs, tokens_per_bs=k, capture=cap,
            global_num_tokens_gpu=s["gpu"], global_num_tokens_for_logprob_gpu=s["lp"], gpu_shape=s["shape"],
            padded_seq_lens=padded_request_seq_lens(seq_lens, live.raw_bs, bs, k), seq_lens_sum=None if view is None else int(view.seq_lens_sum),
            seq_lens_sum_actual=sum(seq_lens[:n]), rows_fed=self.capture_rows[bs][0], logits_rows=self.capture_rows[bs][1],
            captured_bs=self.capture_bs,
        )
        ex = expanded(live, k)
        return rec, int(out[0].shape[0]), LaneRecord(KIND, 0, "", ex.raw_bs, n, 1, s["lanes"]), ex


def check(fk: FrozenKVMTP, layout: ParallelLayout, d: int, tp_rank: int, line, per_request: dict) -> None:
    """P1 and the padded lanes of the frozen draft loop's graphs: DECODE counts bs * topk tokens per DP rank, every one a
    logits row (for_logprob = num_tokens = bs * topk), the bucket the largest DP group's requests need, the padded rows of
    the expanded buffers reset to the fill value / 0."""
    k, cfg, seen = fk.k, fk.cfg, {}
    own = d if layout.require_mlp_tp_gather else 0
    for it, dp_sizes in enumerate(schedule(layout, fk.capture_bs)):
        raw = dp_sizes[d]
        needed = max(dp_sizes) if layout.require_mlp_tp_gather else raw
        live = live_batch(raw, dp_sizes, it, cfg.num_draft_tokens, cfg.max_running_requests)
        rec, returned, lanes, ex = fk.replay(live)
        ln = line(KIND, 0, rec.bs)
        ln.raw_bs.add(raw)
        ln.ranks.add(tp_rank)
        ln.tokens_per_bs = k
        check_replay_record(ln.verdict, layout, rec, tp_rank, it, needed, require_host_lists=False, tokens_aligned=True)
        w = {"layout": layout.describe(), "branch": layout.branch.value, "runner": KIND, "step": 0, "rank": tp_rank,
             "iteration": it, "raw_bs": raw, "bs": rec.bs}
        lp = rec.global_num_tokens_for_logprob_gpu
        if lp is not None:
            ln.verdict.expect_equal("I2", "global_num_tokens_for_logprob", w, rec.rows_fed, lp[own], "rows fed to lm_head on this rank")
        ln.verdict.expect_equal("padding", "returned rows", w, raw, returned, "the draft loop's outputs handed back: one row per real request")
        check_lanes(ln.verdict, lanes, ex, seen, w, FILLED)
    check_captures(fk, layout, tp_rank, line, verify_capture_bs(layout, cfg.capture_bs, cfg.max_running_requests, k), per_request, own)
