"""SGLang's target verify graphs (the target's DecodeCudaGraphRunner in TARGET_VERIFY mode), driven up to the model call.

A verify graph replays the target model on every draft token of every request: a bug in
its capture or replay fill corrupts committed tokens, not just acceptance (docs/engine-check.md,
the target verify graphs). The runner's __init__ (its capture_forward_mode, num_tokens_per_bs / captured_req_width,
get_batch_sizes_to_capture, the static buffers and their registry), capture_one_shape
(capture_prepare's forward batch, gathered gpu tensors, spec_info and the body's
set_dp_buffer_len) and execute (can_run_graph, load_batch: the bucket and the registry's
replay fill) are the engine's. The model is handle.py's ModelProbe: it stops the capture
body at the model call; at a replay the graph launch snapshots the static buffers. The
records come out of handle.RunnerHandle with runner `target_verify`, so check.py applies
the same P1 checks as to the draft-extend runners.

Releases whose target graphs are the older cuda_graph_runner.CudaGraphRunner
(capture_one_batch_size / replay_prepare / replay, up to 0.5.13.post1) are not driven:
`load()` says why, and the report says n/a.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import types
import warnings
from typing import Any, Callable, Iterator, Optional

import torch

from harness.engines.lanes import LaneRecord, LiveBatch, check_lanes, live_batch, schedule
from harness.engines.record_checks import check_captures, check_record
from harness.engines.sglang.errors import EngineAdapterError
from harness.engines.sglang.graph import FakeGraphBackend, ModelProbe, recording_set_dp_buffer_len
from harness.engines.sglang.handle import RunnerHandle
from harness.engines.sglang.standins import FakeGroup, Strict, noop, patched
from harness.props.p1_records import verify_capture_bs
from harness.run.records import ReplayRecord
from runners.parallel.layout import ParallelLayout

MODULE = "sglang.srt.model_executor.runner.decode_cuda_graph_runner"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
KIND = "target_verify"
# ModelRunner methods the runner calls (0.5.15 on; renamed in 0.5.16); bound to the stand-in, so what they derive is the release's own
BOUND_METHODS = ("decode_num_tokens_per_bs", "decode_num_tokens_per_req", "attn_tp_sequence_sharded")


def load(engine: Any) -> tuple[Optional[types.ModuleType], Optional[type], str]:
    """The runner module and the release's ModelRunner class, or None with the reason the verify graphs are not driven."""
    if importlib.util.find_spec(MODULE.rsplit(".", 1)[0]) is None:
        return None, None, ("the target's graphs are cuda_graph_runner.CudaGraphRunner (capture_one_batch_size / replay_prepare / "
                            "replay), an older graph-runner API the adapter does not drive")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = importlib.import_module(MODULE)
            model_runner = importlib.import_module(MODEL_RUNNER)
    except Exception as e:  # an import the release needs that our stubs lack: not a verdict
        return None, None, f"importing {MODULE} raised {type(e).__name__}: {e}"
    cls = getattr(mod, "DecodeCudaGraphRunner", None)
    missing = [n for n in ("capture_prepare", "capture_one_shape", "load_batch", "execute", "can_run_graph") if cls is None or not hasattr(cls, n)]
    if missing:
        return None, None, f"its DecodeCudaGraphRunner has no {', '.join(missing)} (a graph-runner API the adapter does not drive)"
    if not hasattr(mod, "set_dp_buffer_len"):
        return None, None, "the runner module does not call set_dp_buffer_len"
    if not hasattr(mod.set_dp_buffer_len, "__wrapped_engine__"):
        mod.set_dp_buffer_len = recording_set_dp_buffer_len(mod.set_dp_buffer_len)
    return mod, model_runner.ModelRunner, ""


@contextlib.contextmanager
def _no_graph_capture(*args: Any, **kwargs: Any) -> Iterator[Any]:
    yield types.SimpleNamespace(stream=None)


def run_capture(engine: Any, layout: ParallelLayout, tp_rank: int, mod: types.ModuleType, runner: Any) -> None:
    """The engine's capture() of a DecodeCudaGraphRunner (or a subclass): the seq_lens fill and index-buffer reset before
    it, every bucket largest first through capture_one_shape. What only a GPU has is stood in, in `mod` (the decode runner
    module, where the capture loop reads it): the graph-capture stream and its memory probe; and the garbage-collector
    freeze around it (no effect on what is captured); the progress bar is the stub tqdm's (stubs.py)."""
    v = engine.version
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(mod, "graph_capture", _no_graph_capture, v, "the graph-capture stream context"))
        stack.enter_context(patched(mod, "get_available_gpu_memory", lambda *a, **k: 0.0, v, "the capture loop's memory probe"))
        stack.enter_context(patched(mod, "freeze_gc", lambda *a, **k: contextlib.nullcontext(), v, "the gc freeze around capture"))
        parallel = getattr(engine.modules.get("runtime_context"), "get_parallel", None)
        if parallel is not None:  # the capture loop hands the TP group to torch.compile's model patch (not compiling here)
            stack.enter_context(parallel().override(tp_group=FakeGroup("tp", layout.tp_size, tp_rank)))
        if hasattr(mod, "get_or_create_global_graph_capture_stream"):
            stack.enter_context(patched(mod, "get_or_create_global_graph_capture_stream", noop, v, "the capture stream"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runner.capture()


def as_target(mr: Strict, model_runner_cls: type) -> None:
    """The draft stand-in as the target's model runner: not a draft worker, and without the optional features the
    verify runner asks about (LoRA, hierarchical sparse attention, n-gram embedding, pipeline proxies, hooks); the
    release's own ModelRunner methods the runner calls are bound to it."""
    for name, val in dict(is_draft_worker=False, lora_manager=None, hisparse_coordinator=None, use_ngram_embedding=False,
                          ngram_embedding_manager=Strict("ngram_embedding_manager", enabled=False), capture_head_hooks=[],
                          capture_tail_hooks=[], shared_read_done_event=None, get_pp_proxy_topk_size=lambda: None,
                          get_pp_proxy_residual_num_blocks=lambda: None, get_pp_proxy_dspark_hidden_size=lambda: None,
                          get_aux_hidden_states_width=lambda: None).items():
        setattr(mr, name, val)
    for name in BOUND_METHODS:
        if hasattr(model_runner_cls, name):
            setattr(mr, name, types.MethodType(getattr(model_runner_cls, name), mr))
    mc = mr.model_config
    mc.is_encoder_decoder = False
    mc.hf_text_config = mc.hf_config


@dataclasses.dataclass(frozen=True)
class SpecBake:
    """What capture_prepare's spec_info (EagleVerifyInput) baked for one bucket: the verify's tree width and the
    buffers its attention reads, sized for the capture batch."""

    draft_token_num: int
    hidden_rows: Optional[int]  # spec_info.hidden_states rows (MTP models read them): one per token
    custom_mask_len: Optional[int]  # the static tree-mask buffer the capture batch's attention plans with
    seq_lens_sum: int  # the capture batch's (fill-valued) seq_lens, which the mask covers with its T rows per token


class TargetVerify:
    """One rank's target verify runner: built on build.py's stand-ins as the target's, captured per bucket, replayed."""

    def __init__(self, mod: types.ModuleType, model_runner_cls: type, runners: Any, kind: str = KIND, algorithm: str = "EAGLE",
                 verify_input: Optional[Callable[..., Any]] = None) -> None:
        """kind: the report lines' runner; algorithm: the target's speculative algorithm (its verify spec input: EAGLE's
        EagleVerifyInput, the DFlash family's DFlashVerifyInput); verify_input(T, tokens, raw_bs): the replay batch's spec
        input as that algorithm's worker builds it (None: EAGLE's, with its tree mask)."""
        self.engine, self.cfg, self.layout, self.tp_rank = runners.engine, runners.cfg, runners.layout, runners.tp_rank
        self.kind, self.verify_input = kind, verify_input
        attn = runners._attn()
        mr = runners._model_runner(runners.server_args, attn)
        as_target(mr, model_runner_cls)
        if algorithm != "EAGLE":
            mr.spec_algorithm = self.engine.modules["spec_info"].SpeculativeAlgorithm.from_string(algorithm)
        Runner = mod.DecodeCudaGraphRunner
        runner = object.__new__(Runner)
        vars(runner)["capture"] = noop  # __init__ ends by capturing, before the adapter can stand in for the graph: capture() below
        with patched(mod, "resolve_decode_backend", lambda r: None, self.engine.version, "the graph backend"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                Runner.__init__(runner, mr)
        del vars(runner)["capture"]
        self.handle = h = RunnerHandle(self.engine, kind, 0, runner, attn, self.layout, self.cfg)
        runner.backend = FakeGraphBackend(h)
        # the MoE dispatch mode switch around capture / replay (a DeepEP buffer, absent here): no token counts involved
        runner.deepep_adapter = Strict("deepep_adapter", capture=noop, replay=noop)
        # torch.cpu has no graph capture or events: the body runs as the warm-up does (not capturing), and the events
        # that mark where the replay stops reading shared buffers (for the scheduler's write-after-read barrier) mark nothing
        runner.device_module = Strict("device_module", is_current_stream_capturing=lambda: False,
                                      Event=lambda: Strict("event", record=noop))
        if not isinstance(mr.model, ModelProbe):
            raise EngineAdapterError(f"sglang {self.engine.version}: the verify runner's model_runner is not the adapter's")
        mr.model.handle = h
        run_capture(self.engine, self.layout, self.tp_rank, mod, runner)
        self.spec: dict[int, SpecBake] = {}
        for bs in h.capture_bs:
            if bs not in h.captures:
                raise EngineAdapterError(f"sglang {self.engine.version}: capturing bucket {bs} of the verify runner recorded nothing")
            self.spec[bs] = self._spec_bake(h._batches[bs])
            if not runner.require_gathered_buffer:
                # DecodeInputBuffers allocates both gathered tensors in every branch; without a gathered buffer nothing
                # fills them (they hold whatever the process-wide buffer pool last held) and the batch gathers with no
                # host counts (checked on the host lists), so the record says "no gathered buffer"
                h.captures[bs] = dataclasses.replace(h.captures[bs], global_num_tokens_gpu=None, global_num_tokens_for_logprob_gpu=None)

    @staticmethod
    def _spec_bake(fb: Any) -> SpecBake:
        spec = fb.spec_info
        if spec is None:
            raise EngineAdapterError("the verify runner captured a batch without spec_info (EagleVerifyInput)")
        hidden, mask = getattr(spec, "hidden_states", None), getattr(spec, "custom_mask", None)
        return SpecBake(int(spec.draft_token_num), None if hidden is None else int(hidden.shape[0]),
                        None if mask is None else int(mask.numel()), int(fb.seq_lens_sum))

    @property
    def tokens_per_bs(self) -> int:
        return self.handle.tokens_per_bs

    @property
    def capture_bs(self) -> list[int]:
        return self.handle.capture_bs

    # ---- replay ----
    def _forward_batch(self, live: LiveBatch) -> Any:
        """The verify batch the worker hands the runner: every request's T draft tokens, its tree mask on spec_info."""
        fbi = self.engine.modules["fbi"]
        T, raw = self.tokens_per_bs, live.raw_bs
        seq_lens = torch.tensor(live.seq_lens, dtype=torch.int64)
        tok = {k: torch.tensor(v, dtype=torch.int64) for k, v in live.tokens(T).items()}
        full = fbi.CaptureHiddenMode.FULL  # EAGLE's verify returns every token's hidden state to the draft
        if self.verify_input is not None:
            spec = self.verify_input(T, tok, raw)
        else:
            spec = types.SimpleNamespace(draft_token_num=T, num_tokens_per_req=T, capture_hidden_mode=full, hidden_states=None,
                                         custom_mask=torch.ones(T * (int(seq_lens.sum()) + raw * T), dtype=torch.bool))
        fb = fbi.ForwardBatch(forward_mode=fbi.ForwardMode.TARGET_VERIFY, batch_size=raw, input_ids=tok["input_ids"],
                              req_pool_indices=torch.tensor(live.req_pool_indices, dtype=torch.int64), seq_lens=seq_lens,
                              out_cache_loc=tok["out_cache_loc"], seq_lens_sum=int(seq_lens.sum()))
        dp_sizes = list(live.dp_batch_sizes)
        extra = dict(seq_lens_cpu=seq_lens.clone(), positions=tok["positions"], spec_info=spec, capture_hidden_mode=full,
                     original_global_num_tokens_cpu=dp_sizes, global_num_tokens_cpu=[b * T for b in dp_sizes],
                     global_num_tokens_for_logprob_cpu=[b * T for b in dp_sizes], can_run_dp_cuda_graph=True,
                     can_run_decode_cuda_graph=True)
        for key, val in extra.items():
            setattr(fb, key, val)
        return fb

    def replay(self, live: LiveBatch) -> tuple[ReplayRecord, Optional[int], list[LaneRecord]]:
        """One verify replay of the live batch, as the worker drives it: can_run_graph, then execute up to the launch."""
        fb = self._forward_batch(live)
        r = self.handle.runner
        if not r.can_run_graph(fb):
            raise EngineAdapterError(f"sglang {self.engine.version}: the verify runner refused a batch of {live.raw_bs} (can_run_graph)")
        self.handle.attn.last_replay_view = None
        out = r.execute(fb)
        rec, returned, lanes = self.handle.record(live, int(out.next_token_logits.shape[0]))
        if not r.require_gathered_buffer:  # as at capture: unfilled, unread
            rec = dataclasses.replace(rec, global_num_tokens_gpu=None, global_num_tokens_for_logprob_gpu=None, gpu_shape=None)
        return rec, returned, lanes


def check(tv: TargetVerify, layout: ParallelLayout, d: int, tp_rank: int, line, filled: frozenset[str],
                         per_request: dict) -> None:
    """The target verify graphs: P1 on every capture and replay as for the draft-extend runners (TARGET_VERIFY computes
    logits for every token, so for_logprob = num_tokens = rows fed to lm_head = bs * T), its spec_info as baked, and
    the padded lanes of the buffers its replay fill resets."""
    T, cfg, seen, own = tv.tokens_per_bs, tv.cfg, {}, d if layout.require_mlp_tp_gather else 0
    # replay first, as for the draft-extend runners: a line's first failure is then the one our own P1 reports first
    for it, dp_sizes in enumerate(schedule(layout, tv.capture_bs)):
        raw = dp_sizes[d]
        live = live_batch(raw, dp_sizes, it, T, cfg.max_running_requests)
        rec, returned, lanes = tv.replay(live)
        ln = line(tv.kind, 0, rec.bs)
        check_record(ln, layout, rec, returned, tp_rank, it, max(dp_sizes) if layout.require_mlp_tp_gather else raw, tokens_aligned=True)
        w = {"layout": layout.describe(), "branch": layout.branch.value, "runner": tv.kind, "step": 0, "rank": tp_rank,
             "iteration": it, "raw_bs": raw, "bs": rec.bs}
        for lr in lanes:
            check_lanes(ln.verdict, lr, live, seen, w, filled)
    check_captures(tv.handle, layout, tp_rank, line, verify_capture_bs(layout, cfg.capture_bs, cfg.max_running_requests, T), per_request,
                    own, padding_mode=None)
    for bs, spec in tv.spec.items():
        v = line(tv.kind, 0, bs).verdict
        w = {"layout": layout.describe(), "branch": layout.branch.value, "runner": tv.kind, "step": 0, "rank": tp_rank, "bs": bs}
        v.expect_equal("capture", "spec_info.draft_token_num", w, T, spec.draft_token_num, "the verify tree's tokens per request")
        if spec.hidden_rows is not None:
            v.expect_equal("capture", "spec_info.hidden_states rows", w, bs * T, spec.hidden_rows, "one per token (MTP models read them)")
        if spec.custom_mask_len is not None:
            v.expect_equal("capture", "custom_mask covers the batch", w, True, spec.custom_mask_len >= T * (spec.seq_lens_sum + bs * T),
                           f"T rows of seq_len + T per request: {T * (spec.seq_lens_sum + bs * T)} needed, {spec.custom_mask_len} held")
