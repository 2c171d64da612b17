"""SGLang's UNO graphs (UnoDecodeCudaGraphRunner, 0.5.20 on), driven up to the model call.

UNO drafts with the target model itself: one iteration is two F-wide TARGET_VERIFY forwards over
the same requests (F = speculative_num_draft_tokens), a draft pass in which each request's F - 1
proposal rows run an internal LoRA adapter (its first row, the bonus token, runs the base model)
and a verify pass on the base model alone. In linear mode (topk 1) the target's decode graph
runner is UnoDecodeCudaGraphRunner with two graphs per bucket, keyed by variant label: "lora" for
the draft pass (UNO_DRAFT spec input), "nolora" for the verify pass (UNO_VERIFY). The LoRA routing
the draft pass needs (which token rows run the adapter) is baked into the "lora" graph at capture
(uno_lora.UnoCudaGraphLoRAState.capture_draft) and never re-prepared at replay, so what it bakes
is checked against the bucket it replays.

What runs is the engine's: the runner's __init__ (its DecodeCudaGraphRunner base with
record_nolora_graph, the buckets at width F, the static buffers and their registry), the decode
capture loop over both variants of every bucket through UNO's capture_prepare / capture_one_shape
(the LoRA state per variant, the UnoForwardInput), and per replay can_run_graph and execute (the
bucket, the registry's replay fill) up to the graph launch. Stood in: the model (stops the
capture body), the LoRA manager (token-row routing recorded, no weights: UNO loads its adapter
from --uno-lora-path), the attention backend, the graph; the runner's report lines are `uno` step
0 (the draft pass) and step 1 (the verify pass).

UNO requires TP = PP = 1 and rejects DP attention (arg_groups/speculative_hook.py, _handle_uno),
so it is driven on tp1 only, where no gathered buffer exists. Tree mode (topk > 1: a separate
F-wide draft runner and the target's EAGLE verify graphs) is not driven (`TREE_MODE`).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import types
import warnings
from typing import Any, Optional

import torch

from harness.engines.lanes import FILLED_SINCE, LaneRecord, LiveBatch, check_lanes, live_batch, schedule
from harness.engines.record_checks import check_captures, check_record
from harness.engines.sglang.errors import EngineAdapterError, MissingEngineAttribute
from harness.engines.sglang.graph import (
    FakeGraphBackend,
    ModelProbe,
    import_quietly,
    missing_api,
    prepare_runner_module,
)
from harness.engines.sglang.handle import RunnerHandle
from harness.engines.sglang.standins import Strict, noop, patched
from harness.engines.sglang.target_verify import MODEL_RUNNER, as_target, run_capture
from harness.engines.sglang.target_verify import MODULE as DECODE_MODULE
from harness.props.p1_records import verify_capture_bs
from harness.run.records import ReplayRecord
from runners.parallel.layout import ParallelLayout

KIND = "uno"
MODULE = "sglang.srt.speculative.uno_cuda_graph_runner"
INFO = "sglang.srt.speculative.uno_info"
LORA_ID = "__uno_draft__"  # the id the stand-in LoRA manager gives UNO's adapter (uno_lora.py names it so)
# the two forwards of one iteration, in order: (graph variant label, the spec input type its batches carry)
PASSES: tuple[tuple[str, str], ...] = (("lora", "UNO_DRAFT"), ("nolora", "UNO_VERIFY"))
LAYOUTS: tuple[tuple[ParallelLayout, str], ...] = (
    (ParallelLayout(1), "UNO requires TP = PP = 1 and rejects DP attention (arg_groups/speculative_hook.py, _handle_uno)"),)
# the buffers the decode registry's padding policies write (the same registry as the target verify's)
FILLED = frozenset(b for (k, b) in FILLED_SINCE if k == "target_verify")
GATHER_NA = (f"{KIND}: the gathered-buffer invariants (I1 / I4 on the DP counts, I3, the DP buffer, per-DP-rank counts): n/a: "
             "UNO requires TP = PP = 1 and rejects DP attention (arg_groups/speculative_hook.py, _handle_uno: \"UNO requires "
             "TP=PP=1.\", \"UNO does not support DP attention or context parallelism.\"), so no UNO layout has a gathered buffer; "
             "driven on tp1, where the checks say so (no gathered tensor, no host counts)")
TREE_MODE = (f"{KIND}: tree mode (speculative_eagle_topk > 1): not driven: its target graphs are the EAGLE verify graphs "
             "(UnoDecodeCudaGraphRunner with an EagleVerifyInput, one variant), and its F-wide draft graph a second runner the "
             "worker builds inside _bind_uno_draft_runtime (uno_worker_v2.py, init_cuda_graphs) on a private attention backend; "
             "linear mode, driven, runs the same capture and replay code per variant")


@dataclasses.dataclass(frozen=True)
class Loaded:
    mod: types.ModuleType
    decode: types.ModuleType
    info: types.ModuleType
    model_runner_cls: type


def load(engine: Any) -> tuple[Optional[Loaded], str]:
    if importlib.util.find_spec(MODULE) is None:
        return None, "the release ships no speculative/uno_cuda_graph_runner.py (it is in 0.5.20 on)"
    mods, why = import_quietly(MODULE, INFO, DECODE_MODULE, MODEL_RUNNER)
    if mods is None:
        return None, why
    mod, info, decode, mr = mods
    missing = missing_api(getattr(mod, "UnoDecodeCudaGraphRunner", None), ("capture_prepare", "capture_one_shape", "can_run_graph",
                                                                           "get_spec_info", "execute"))
    if missing:
        return None, f"its UnoDecodeCudaGraphRunner has no {', '.join(missing)} (a graph-runner API the adapter does not drive)"
    prepare_runner_module(decode, noop)
    return Loaded(mod, decode, info, mr.ModelRunner), ""


def layouts(run_layouts: tuple[ParallelLayout, ...]) -> tuple[tuple[ParallelLayout, str], ...]:
    """Fixed, whatever the run's layouts (the module doc says why)."""
    return LAYOUTS


class LoraRouting:
    """UNO's LoRA manager as the runner uses it: which token rows run the adapter (recorded), no weights.

    UnoCudaGraphLoRAState prepares a bucket's routing (prepare_lora_token_segments) and installs it as the LoRA
    backend's batch_info for the draft capture; reset_lora_batch clears it. `active()` is what the model call would run
    with."""

    def __init__(self) -> None:
        self.lora_backend = Strict("lora_backend", batch_info=None, skip_inactive_dense_lora=False)
        self.attn_dp_enabled = self.enable_dp_attention = False  # DP attention is off for UNO (0.5.21 reads the second name)

    def reset_lora_batch(self) -> None:
        self.lora_backend.batch_info = None

    def prepare_lora_token_segments(self, lora_ids: list, segment_lens: list[int]) -> None:
        self.lora_backend.batch_info = types.SimpleNamespace(lora_ids=list(lora_ids), segment_lens=[int(x) for x in segment_lens],
                                                             use_cuda_graph=False)

    def init_decode_cuda_graph_batch_info(self, *args: Any, **kwargs: Any) -> None:
        pass  # the dense LoRA batch metadata a GPU LoRA kernel reads: no kernel here

    init_cuda_graph_batch_info = init_decode_cuda_graph_batch_info  # its name up to 0.5.22

    def active(self) -> Optional[tuple[list, list[int]]]:
        b = self.lora_backend.batch_info
        return None if b is None else (list(b.lora_ids), list(b.segment_lens))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise MissingEngineAttribute(f"the engine used lora_manager.{name}, which the adapter's LoRA stand-in does not provide")


class VariantBackend(FakeGraphBackend):
    """The decode graph backend with UNO's graph keys: one graph per (bucket, variant label), each a pass's handle."""

    def capture_one(self, shape_key: Any, run_once: Any, *args: Any, **kwargs: Any) -> None:
        owner, bs, label = self.handle, int(shape_key.size), shape_key.variant_label
        h = owner.capturing = owner.pass_of(label)
        h.run_body_until_model(bs, run_once)
        owner.routing[(label, bs)] = owner.lora.active()
        self.outputs[(bs, label)] = h.fake_output(bs)

    def replay(self, shape_key: Any, forward_batch: Any) -> Any:
        bs, label = int(shape_key.size), shape_key.variant_label
        self.handle.launched = label
        self.handle.pass_of(label).on_replay(bs)
        return self.outputs[(bs, label)]

    def can_run(self, forward_batch: Any, key: Any) -> bool:
        return (int(key.size), key.variant_label) in self.outputs


class Uno:
    """One linear-UNO target runner on tp1: built on build.py's stand-ins as the target's, both variants captured, replayed."""

    def __init__(self, loaded: Loaded, runners: Any) -> None:
        self.loaded, self.engine, self.cfg, self.layout = loaded, runners.engine, runners.cfg, runners.layout
        attn = runners._attn()
        mr = runners._model_runner(runners.server_args, attn)
        as_target(mr, loaded.model_runner_cls)
        mr.spec_algorithm = self.engine.modules["spec_info"].SpeculativeAlgorithm.from_string("UNO")
        self.lora = LoraRouting()
        mr.lora_manager, mr.uno_lora_id = self.lora, LORA_ID
        Runner = loaded.mod.UnoDecodeCudaGraphRunner
        runner = object.__new__(Runner)
        vars(runner)["capture"] = noop  # __init__ ends by capturing, before the adapter can stand in for the graph: run_capture below
        with patched(loaded.decode, "resolve_decode_backend", lambda r: None, self.engine.version, "the graph backend"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                Runner.__init__(runner, mr)
        del vars(runner)["capture"]
        self.runner = runner
        self.handles = [RunnerHandle(self.engine, KIND, step, runner, attn, self.layout, self.cfg) for step in range(len(PASSES))]
        self.routing: dict[tuple[Optional[str], int], Optional[tuple[list, list[int]]]] = {}
        self.capturing: Optional[RunnerHandle] = None
        self.launched: Optional[str] = None
        runner.backend = VariantBackend(self)
        runner.deepep_adapter = Strict("deepep_adapter", capture=noop, replay=noop)
        runner.device_module = Strict("device_module", is_current_stream_capturing=lambda: False, Event=lambda: Strict("event", record=noop))
        if not isinstance(mr.model, ModelProbe):
            raise EngineAdapterError(f"sglang {self.engine.version}: the UNO runner's model_runner is not the adapter's")
        mr.model.handle = self
        run_capture(self.engine, self.layout, runners.tp_rank, loaded.decode, runner)
        for h in self.handles:
            for bs in h.capture_bs:
                if bs not in h.captures:
                    raise EngineAdapterError(f"sglang {self.engine.version}: capturing bucket {bs} of UNO's {PASSES[h.step][0]} graph recorded nothing")
                if not runner.require_gathered_buffer:  # as for the target verify: allocated in every branch, unfilled and unread here
                    h.captures[bs] = dataclasses.replace(h.captures[bs], global_num_tokens_gpu=None, global_num_tokens_for_logprob_gpu=None)

    def pass_of(self, label: Optional[str]) -> RunnerHandle:
        labels = [p[0] for p in PASSES]
        if label not in labels:
            raise EngineAdapterError(f"sglang {self.engine.version}: the UNO runner keyed a graph by variant {label!r}, not one of {labels}")
        return self.handles[labels.index(label)]

    def on_model_forward(self, fb: Any) -> Any:
        """The model stand-in's call: the pass being captured records the batch (and stops the body)."""
        if self.capturing is None:
            raise EngineAdapterError("the UNO runner ran the model outside a capture the adapter drove")
        return self.capturing.on_model_forward(fb)

    @property
    def width(self) -> int:
        return self.handles[0].tokens_per_bs

    def _forward_batch(self, live: LiveBatch, spec_type: str) -> Any:
        """The batch UnoWorkerV2._make_forward_batch builds for one pass: TARGET_VERIFY over F rows per request, UNO's
        forward input carrying the pass (the release's own UnoForwardInput)."""
        fbi, F = self.engine.modules["fbi"], self.width
        seq_lens = torch.tensor(live.seq_lens, dtype=torch.int64)
        tok = {k: torch.tensor(v, dtype=torch.int64) for k, v in live.tokens(F).items()}
        spec = self.loaded.info.UnoForwardInput(spec_input_type=getattr(self.engine.modules["spec_info"].SpecInputType, spec_type),
                                                positions=tok["positions"], draft_token_num=F)
        fb = fbi.ForwardBatch(forward_mode=fbi.ForwardMode.TARGET_VERIFY, batch_size=live.raw_bs, input_ids=tok["input_ids"],
                              req_pool_indices=torch.tensor(live.req_pool_indices, dtype=torch.int64), seq_lens=seq_lens,
                              out_cache_loc=tok["out_cache_loc"], seq_lens_sum=int(seq_lens.sum()))
        for key, val in dict(seq_lens_cpu=seq_lens.clone(), positions=tok["positions"], spec_info=spec,
                             spec_algorithm=self.runner.model_runner.spec_algorithm, capture_hidden_mode=fbi.CaptureHiddenMode.NULL,
                             can_run_decode_cuda_graph=True).items():
            setattr(fb, key, val)
        return fb

    def replay(self, live: LiveBatch, step: int) -> tuple[ReplayRecord, Optional[int], list[LaneRecord], Optional[str]]:
        """One pass of an iteration, as the worker drives it: can_run_graph, then execute up to the launch."""
        label, spec_type = PASSES[step]
        fb = self._forward_batch(live, spec_type)
        r = self.runner
        if not r.can_run_graph(fb):
            raise EngineAdapterError(f"sglang {self.engine.version}: the UNO runner refused a {spec_type} batch of {live.raw_bs} (can_run_graph)")
        self.launched, r.attn_backend.last_replay_view = None, None
        out = r.execute(fb)
        h = self.pass_of(self.launched) if self.launched is not None else self.handles[step]
        rec, returned, lanes = h.record(live, int(out.next_token_logits.shape[0]))
        if not r.require_gathered_buffer:
            rec = dataclasses.replace(rec, global_num_tokens_gpu=None, global_num_tokens_for_logprob_gpu=None, gpu_shape=None)
        return rec, returned, lanes, self.launched


def check(uno: Uno, layout: ParallelLayout, d: int, tp_rank: int, line, per_request: dict) -> None:
    """Both passes of every iteration: P1 on each replay as for the target verify (TARGET_VERIFY computes logits for
    every row: for_logprob = num_tokens = rows fed to lm_head = bs * F; no gathered buffer on tp1), the graph variant each
    pass launches, the LoRA routing each variant baked, and the padded lanes of the registry's replay fill."""
    F, cfg = uno.width, uno.cfg
    seen: dict = {}
    base = {"layout": layout.describe(), "branch": layout.branch.value, "runner": KIND, "rank": tp_rank}
    for it, dp_sizes in enumerate(schedule(layout, uno.handles[0].capture_bs)):
        raw = dp_sizes[d]
        live = live_batch(raw, dp_sizes, it, F, cfg.max_running_requests)
        for step, (label, spec_type) in enumerate(PASSES):
            rec, returned, lanes, launched = uno.replay(live, step)
            ln = line(KIND, step, rec.bs)
            w = {**base, "step": step, "iteration": it, "raw_bs": raw, "bs": rec.bs}
            ln.verdict.expect_equal("replay", "graph variant", w, label, launched,
                                    f"a {spec_type} batch replays the graph captured for that pass (UnoDecodeCudaGraphRunner._resolve_lora_variant)")
            check_record(ln, layout, rec, returned, tp_rank, it, raw, tokens_aligned=True)
            for lr in lanes:
                check_lanes(ln.verdict, lr, live, seen, w, FILLED)
    for step, (label, spec_type) in enumerate(PASSES):
        h = uno.handles[step]
        check_captures(h, layout, tp_rank, line, verify_capture_bs(layout, cfg.capture_bs, cfg.max_running_requests, F), per_request, 0,
                       padding_mode=None)
        for bs in h.capture_bs:
            v = line(KIND, step, bs).verdict
            w = {**base, "step": step, "bs": bs}
            spec = h._batches[bs].spec_info
            v.expect_equal("capture", "spec_input_type", w, spec_type, getattr(getattr(spec, "spec_input_type", None), "name", None),
                           f"the {label} graph is captured with the spec input of its pass")
            v.expect_equal("capture", "LoRA routing", w, expected_routing(label, bs, F), uno.routing.get((label, bs)),
                           "(adapter ids, token rows) the graph bakes: each request's first row on the base model, its F - 1 proposal "
                           "rows on UNO's adapter (draft pass); none on the verify pass")


def expected_routing(label: str, bs: int, F: int) -> Optional[tuple[list, list[int]]]:
    """What the draft pass's graph must run, read from uno_worker_v2 (_run_draft_block routes an eager batch the same way):
    per request a base-model segment of one row (the bonus token) and an adapter segment of F - 1 rows; the verify pass none."""
    if label != "lora" or F <= 1:
        return None
    return [None, LORA_ID] * bs, [1, F - 1] * bs
