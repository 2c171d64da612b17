"""One engine graph runner (a multi-layer step or the single-layer runner): capture it, snapshot its replays, convert to our records.

The capture path is the engine's own, stopped at the model call (graph.ModelProbe): what the
step body baked by then -- the batch from get_forward_batch(bs), the DP buffer it set, the
gathered gpu tensors -- is what the graph would bake. At the graph launch of a replay the
static buffers the graph would read are snapshotted; `record()` turns both into our
harness.run.records.CaptureRecord / ReplayRecord, which harness.props checks.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from harness.engines.after_model import BodyRecord, hidden_rows, lm_head
from harness.engines.lanes import PER_REQUEST, PER_TOKEN, LaneRecord, LiveBatch
from harness.engines.sglang.config import EngineConfig
from harness.engines.sglang.errors import EngineAdapterError
from harness.engines.sglang.graph import (
    DP_CALLS,
    AttnRecorder,
    FakeGraph,
    FakeGraphBackend,
    ModelProbe,
    Snapshot,
    baked_at_model,
    run_until_model,
    stop_at_model,
    tolist,
)
from harness.engines.sglang.loader import Engine
from harness.engines.sglang.standins import Strict
from harness.run.records import CaptureRecord, ReplayRecord, batch_fields
from runners.parallel.layout import Branch, ParallelLayout

# Older names of the same buffers: 0.5.11 says num_accepted_*, releases up to 0.5.10 accept_length (drafts + bonus).
LANE_ALIASES = {"num_correct_drafts": ("num_correct_drafts", "num_accepted_drafts"),
                "num_accept_tokens": ("num_accept_tokens", "num_accepted_tokens", "accept_length")}
# The multi-layer draft-extend paths: the per-step composite (a graph per step) and, 0.5.16 on, the one-graph
# composite (every step and the chain rotation in one graph per bucket): each its own report lines.
ONE_GRAPH = "multi_layer_1g"
MULTI_LAYER = ("multi_layer", ONE_GRAPH)


class RunnerFacts:
    """What the engine derived for one of its runners (`self.runner`, of `self.engine`): its width, buckets and branch."""

    runner: Any
    engine: Engine

    @property
    def tokens_per_bs(self) -> int:
        return captured_width(self.runner, self.engine.version)

    @property
    def capture_bs(self) -> list[int]:
        return [int(b) for b in self.runner.capture_bs]

    @property
    def engine_branch(self) -> str:
        r = self.runner
        if r.require_mlp_tp_gather:
            return Branch.MLP_TP_GATHER.value
        if r.require_attn_tp_gather:
            return Branch.ATTN_TP_GATHER.value
        return Branch.NEITHER.value


class RunnerHandle(RunnerFacts):
    """One engine graph runner (a multi-layer step or the single-layer runner) and what it baked."""

    def __init__(self, engine: Engine, kind: str, step: int, runner: Any, attn: AttnRecorder, layout: ParallelLayout, cfg: EngineConfig) -> None:
        self.engine, self.kind, self.step, self.runner, self.attn, self.layout, self.cfg = engine, kind, step, runner, attn, layout, cfg
        self.captures: dict[int, CaptureRecord] = {}
        self._batches: dict[int, Any] = {}  # bs -> the capture-time forward batch the model was called with
        self.capture_rows: dict[int, tuple[int, int]] = {}  # bs -> (rows fed to lm_head, logits rows)
        self.snapshots: list[Snapshot] = []
        # past the model call: the captured step body per bucket, run again at replay where drive_body is set
        self.drive_body = False
        self._bodies: dict[int, Callable] = {}
        self.replaying = False  # the body runs past the model call (a driven replay): the model answers with the stand-in
        self.base_width = 0  # step 0's window (set by the builder)
        self.last_body: Optional[tuple[Any, list[int]]] = None  # (the body's output, input_ids at launch)
        self.on_launch: Optional[Callable[["RunnerHandle", int], None]] = None  # called at each graph launch (logits_gather.py)
        self.last_logits: Optional[torch.Tensor] = None  # the stand-in model's logits at this runner's last driven model call

    def _buffers(self) -> Any:
        """The runner's static buffers: an InputBuffers from 0.5.10 on, attributes of the runner itself before."""
        return getattr(self.runner, "buffers", self.runner)

    # ---- capture ----
    def fake_output(self, bs: int) -> Any:
        """What the graph's output buffers would hold: the batch's logits buffer, hidden states, top-k."""
        fb = self._batches.get(bs)
        LPO = self.engine.modules["logits"].LogitsProcessorOutput
        n = bs * self.tokens_per_bs
        logits = fb.next_token_logits_buffer if fb is not None and fb.next_token_logits_buffer is not None else torch.zeros(n, self.cfg.vocab_size)
        out = LPO(next_token_logits=logits, hidden_states=torch.zeros(n, self.cfg.hidden_size))
        out.topk_p = torch.ones(bs, self.cfg.topk)
        out.topk_index = torch.zeros(bs, self.cfg.topk, dtype=torch.int64)
        return out

    def run_body_until_model(self, bs: int, run_once: Callable) -> None:
        """Run the captured step body (the warm-up) up to the model call, then stop it there.

        The prefix is the engine's own: it clears the DP-local scratch, sets the DP buffer
        (set_dp_buffer_len: the token counts DP attention will gather with) and calls the
        model with the capture-time batch. The model stand-in records the batch, the DP
        buffer it was given and the rows the logits processor would feed lm_head, and stops.
        """
        self._bodies[bs] = run_once
        self._body = run_until_model(run_once, f"sglang {self.engine.version}: the {self.kind} runner's capture body for bucket {bs}")
        self._record_capture(bs)

    def on_model_forward(self, fb: Any) -> Any:
        """The body called the model: at capture, the batch, the DP buffer and the gathered gpu tensors are
        what the graph bakes (and the body stops); at a replay that drives the body, the stand-in model's output."""
        if self.replaying:
            return self._stand_in_output(fb)
        if self.kind == ONE_GRAPH:  # one capture runs every step's body: record this step's batch and go on
            self._body = baked_at_model(fb, self._buffers(), f"sglang {self.engine.version}: the {self.kind} step body")
            self._record_capture(int(fb.batch_size))
            return self._stand_in_output(fb)
        stop_at_model(fb, self._buffers(), f"sglang {self.engine.version}: the {self.kind} step body")

    def _record_capture(self, bs: int) -> None:
        fb, dp, gpu_tokens, gpu_logprob = self._body
        if int(fb.batch_size) != bs:
            raise EngineAdapterError(f"sglang {self.engine.version}: capturing bucket {bs} of the {self.kind} runner ran the model on a batch "
                                     f"of {fb.batch_size}")
        self._batches[bs] = fb
        def ints(x: Any) -> Optional[list[int]]:
            return None if x is None else [int(v) for v in x]
        body_tokens = ints(dp.get("global_num_tokens"))
        host = {
            "forward_mode": getattr(fb.forward_mode, "name", str(fb.forward_mode)).lower(),
            "batch_size": int(fb.batch_size),
            "num_tokens": int(fb.input_ids.shape[0]),
            "extend_num_tokens": fb.extend_num_tokens,
            # the host token counts: the step body's set_dp_buffer_len(...) (what DP attention gathers with), else the batch's
            "global_num_tokens_cpu": body_tokens if body_tokens is not None else ints(fb.global_num_tokens_cpu),
            "global_num_tokens_for_logprob_cpu": ints(fb.global_num_tokens_for_logprob_cpu),
            "global_dp_buffer_len": dp.get("global_dp_buffer_len"),
            "dp_padding_mode": "max_len" if dp.get("dp_max_padding") else "sum_len",
            # the same values as carried on the forward batch itself (None where the engine leaves them off)
            "fb_global_num_tokens_cpu": ints(fb.global_num_tokens_cpu),
            "fb_global_dp_buffer_len": fb.global_dp_buffer_len,
            "local_dp_buffer_len": dp.get("local_dp_buffer_len"),
        }
        self.captures[bs] = CaptureRecord(bs, int(fb.input_ids.shape[0]), host, gpu_tokens, gpu_logprob, batch_fields(fb))
        self.capture_rows[bs] = (self._rows_fed_to_lm_head(fb), int(fb.next_token_logits_buffer.shape[0]))

    def _rows_fed_to_lm_head(self, fb: Any) -> int:
        """Rows the engine's logits processor would give lm_head for this batch: its own row selection."""
        return int(self.pruned_states(fb, torch.zeros(int(fb.input_ids.shape[0]), 1)).shape[0])

    def pruned_states(self, fb: Any, hidden: torch.Tensor) -> torch.Tensor:
        return pruned_states(self.engine, fb, hidden)

    def launched_batch(self, bs: int) -> Any:
        """The forward batch a replay of bucket bs launches with: the capture-time one (its host values as baked),
        whose tensors are the runner's static buffers as the replay fill left them."""
        return self._batches[bs]

    def _stand_in_output(self, fb: Any) -> Any:
        """The stand-in model's output (after_model.py) for the batch the graph reads, through the engine's own row selection."""
        hidden = hidden_rows(fb.input_ids, self.cfg.hidden_size)
        logits = lm_head(self.pruned_states(fb, hidden))
        buf = getattr(fb, "next_token_logits_buffer", None)
        if buf is not None and tuple(buf.shape) == tuple(logits.shape):
            buf.copy_(logits)  # the logits processor writes into the graph's logits buffer
            logits = buf
        self.last_logits = logits.clone()
        return self.engine.modules["logits"].LogitsProcessorOutput(next_token_logits=logits, hidden_states=hidden)

    def run_body(self, bs: int) -> Any:
        """Run the captured step body again on the static buffers, as the graph's replay would, with the stand-in model."""
        run_once = self._bodies.get(bs)
        if run_once is None:
            raise EngineAdapterError(f"sglang {self.engine.version}: the {self.kind} runner replayed bucket {bs} with no captured body")
        mod = self.engine.modules["ml" if self.kind in MULTI_LAYER else "sl"]
        ctx = contextlib.nullcontext()
        if hasattr(mod, "forward_context") and hasattr(mod, "ForwardContext"):
            ctx = mod.forward_context(mod.ForwardContext(attn_backend=self.attn))  # get_req_to_token_pool() reads it
        self.replaying = True
        try:
            with ctx:
                ret = run_once()
        finally:
            self.replaying = False
            DP_CALLS.clear()
        if ret is None:
            raise EngineAdapterError(f"sglang {self.engine.version}: the {self.kind} runner's step body returned nothing")
        return ret

    def capture_all(self) -> None:
        """Every bucket, largest first, through the engine's capture path, stopping before the graph."""
        r, gen = self.runner, self.engine.generation
        for bs in reversed(self.capture_bs):
            if gen == "legacy":
                self._capturing_bs = bs
                graph, out = r.capture_one_batch_size(bs, None)
                r.graphs[bs] = graph
                r.output_buffers[bs] = out
            else:
                r.capture_one_shape(bs, None)
            if bs not in self.captures:
                raise EngineAdapterError(f"sglang {self.engine.version}: capturing bucket {bs} of the {self.kind} runner recorded nothing")

    def install_graph_stand_ins(self) -> None:
        r, handle = self.runner, self
        if self.engine.generation == "legacy":
            # CudaGraphRunner-era hooks: a graph object, the two warm-ups, the capture itself
            def capture_init(run_once: Callable) -> None:
                handle.run_body_until_model(handle._capturing_bs, run_once)

            def capture_graph(graph: Any, pool: Any, stream: Any, run_once: Callable) -> Any:
                return handle.fake_output(handle._capturing_bs)

            vars(r).update(graphs={}, output_buffers={}, stream=None, _capture_init=capture_init, _capture_graph=capture_graph,
                           _create_graph=lambda: FakeGraph(handle, handle._capturing_bs))
        else:
            r.backend = FakeGraphBackend(self)
        self.bind_model()

    def bind_model(self) -> None:
        """The runner's model stand-in calls this handle back."""
        model = self.runner.model_runner.model
        if not isinstance(model, ModelProbe):
            raise EngineAdapterError(f"sglang {self.engine.version}: the {self.kind} runner's model_runner is not the adapter's")
        model.handle = self

    # ---- replay ----
    def on_replay(self, bs: int) -> None:
        """At the graph launch: the snapshot, then the body where driven."""
        lanes = self.snapshot(bs)
        if self.drive_body:
            ret = self.run_body(bs)
            self.last_body = (ret, lanes["input_ids"])
            out = self.runner.output_buffers[bs] if self.engine.generation == "legacy" else self.runner.backend.outputs[bs]
            write_outputs(out, ret)

    def snapshot(self, bs: int) -> dict[str, Optional[list[int]]]:
        """Where this runner's graph (or its step of the one graph) starts: every buffer it reads, whole (the padded lanes are the point)."""
        buf = self._buffers()
        g = buf.global_num_tokens_gpu
        lanes = {name: tolist(next((getattr(buf, a) for a in LANE_ALIASES.get(name, (name,)) if hasattr(buf, a)), None))
                 for name in (*PER_REQUEST, *PER_TOKEN)}
        fill = self.engine.fill
        if self.kind not in MULTI_LAYER or fill is None:  # a Python fill: the same code on every device
            path, native = "", None
        elif self.kind == ONE_GRAPH:  # built only off NPU: its prepare() fills with the kernel (FillObserver.kernel_alone)
            path, native = "gpu", None
        elif fill.native is None:  # the kernel and no twin (0.5.16): both devices fill with the kernel
            path, native = "", None
        else:  # the kernel ran (the twin perhaps beside it, on clones: last_native), or the twin alone (paths.py)
            path, native = ("gpu", fill.last_native) if fill.kernel else ("npu", None)
        self.snapshots.append(Snapshot(bs, tolist(g), tolist(buf.global_num_tokens_for_logprob_gpu),
                                       None if g is None else tuple(g.shape), [int(x) for x in buf.seq_lens[:bs].tolist()],
                                       lanes, path, native))
        if self.on_launch is not None:
            self.on_launch(self, bs)
        self.last_body = None
        return lanes

    def record(self, live: LiveBatch, returned_rows: Optional[int]) -> tuple[ReplayRecord, Optional[int], list[LaneRecord]]:
        """Turn the last replay's snapshot into our ReplayRecord (plus the rows the engine handed back and its lanes, per fill path)."""
        if not self.snapshots:
            raise EngineAdapterError(f"sglang {self.engine.version}: the {self.kind} runner's replay never reached the graph")
        snap = self.snapshots[-1]
        view = self.attn.last_replay_view
        seq_lens_sum = None if view is None else view.seq_lens_sum
        cap = self.captures.get(snap.bs)
        if cap is None:
            raise EngineAdapterError(f"sglang {self.engine.version}: replay chose bucket {snap.bs}, which was never captured")
        rows_fed, logits_rows = self.capture_rows[snap.bs]
        rec = ReplayRecord(
            runner=self.kind, step=self.step, branch=self.layout.branch.value, raw_bs=live.raw_bs, bs=snap.bs,
            tokens_per_bs=self.tokens_per_bs, capture=cap, global_num_tokens_gpu=snap.global_num_tokens_gpu,
            global_num_tokens_for_logprob_gpu=snap.global_num_tokens_for_logprob_gpu, gpu_shape=snap.gpu_shape,
            padded_seq_lens=snap.seq_lens[live.raw_bs:], seq_lens_sum=seq_lens_sum if seq_lens_sum is None else int(seq_lens_sum),
            seq_lens_sum_actual=sum(snap.seq_lens), rows_fed=rows_fed, logits_rows=logits_rows, captured_bs=self.capture_bs,
            fields={} if view is None else batch_fields(view),  # the batch the replay plans attention with (none: planned in the graph)
        )
        self.attn.last_replay_view = None
        # the lanes as the replay fill left them: step 0 only, where the fill is the last writer (later steps
        # read what the chain wrote inside the graph, which is not run)
        lanes = []
        if self.step == 0:
            lanes.append(LaneRecord(self.kind, self.step, snap.path, live.raw_bs, snap.bs, self.tokens_per_bs, snap.lanes))
            if snap.native is not None:  # the twin's result on the same inputs
                lanes.append(LaneRecord(self.kind, self.step, "npu", live.raw_bs, snap.bs, self.tokens_per_bs, snap.native))
        return rec, returned_rows, lanes

    def body_record(self, live: LiveBatch, returned_logits: Any) -> Optional[BodyRecord]:
        """What the last replay's body produced past the model call (None where the body was not driven)."""
        if self.last_body is None:
            return None
        ret, input_ids = self.last_body
        snap = self.snapshots[-1]
        topk = getattr(ret, "topk_index", None) if self.kind in MULTI_LAYER else None
        returned = [int(x) for x in returned_logits.argmax(dim=-1).tolist()]
        return BodyRecord(self.kind, self.step, live.raw_bs, snap.bs, self.tokens_per_bs, self.base_width or self.tokens_per_bs,
                          len(returned) == live.raw_bs and self.tokens_per_bs != 1, returned,
                          None if topk is None else [int(x) for x in topk[:, 0].tolist()], input_ids or [])


def captured_width(runner: Any, version: str) -> int:
    """The tokens per request a runner captured its graphs with: captured_req_width from 0.5.16 on, num_tokens_per_bs before."""
    for name in ("captured_req_width", "num_tokens_per_bs"):
        if name in vars(runner):
            return int(vars(runner)[name])
    raise EngineAdapterError(f"sglang {version}: {type(runner).__name__} has neither captured_req_width nor num_tokens_per_bs")


def pruned_states(engine: Engine, fb: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The hidden rows the engine's logits processor hands lm_head for this batch (LogitsProcessor._get_pruned_states)."""
    lp = engine.modules["logits"]
    meta = lp.LogitsMetadata.from_forward_batch(fb)
    if not hasattr(lp.LogitsProcessor, "_get_pruned_states"):
        # before 0.5.10 the selection is inline in forward(), whose branch for this mode feeds every hidden row
        if not meta.forward_mode.is_draft_extend_v2():
            raise EngineAdapterError(f"sglang {engine.version}: the capture batch is not DRAFT_EXTEND_V2 and the logits processor has no _get_pruned_states")
        return hidden
    return lp.LogitsProcessor._get_pruned_states(Strict("LogitsProcessor"), hidden, None, None, meta)[0]


def write_outputs(out: Any, ret: Any) -> None:
    """Where the graph would leave its results: the captured output buffers, written in place."""
    for name in ("next_token_logits", "hidden_states", "topk_p", "topk_index"):
        src, dst = getattr(ret, name, None), getattr(out, name, None)
        if src is None or dst is None or src is dst:
            continue
        rows = min(int(src.shape[0]), int(dst.shape[0]))
        if tuple(src.shape[1:]) == tuple(dst.shape[1:]):
            dst[:rows].copy_(src[:rows])
