"""The one-graph multi-layer composite (0.5.16 on): every draft step and the chain rotation in one graph per bucket.

The worker builds it instead of the per-step composite when SGLANG_ENABLE_SINGLE_CG_DRAFT is on
(the default) and every step's attention backend captures its draft-extend metadata in the graph
or stages it (FlashAttention 3, the Hopper default); backends that plan out of graph get the
per-step composite (build.py). Both are defaults, for different backends, so both are driven,
each on its own report lines (runner `multi_layer_1g` here).

What differs from the per-step composite, and what stands in for it here:
* one capture per bucket runs every step's body and the rotation between steps (the warm-up
  is the capture): the model stand-in records each step's capture batch and answers with the
  deterministic stand-in output (after_model.py) so the body goes on to the next step;
* that warm-up rotates input_ids; the composite snapshots its buffers before the capture and
  restores them after, so a replay starts from what prepare() wrote over the capture-time state
  and not over a rotated one: the `restore` check compares every input buffer around
  `_capture_one_graph` (outputs and the per-bucket DP counts excepted, NOT_RESTORED);
* replay(0) launches the one graph; where the body is driven the graph stand-in runs the
  captured body again, and each step's launch is where its backend refreshes metadata in the
  graph (init_forward_metadata_in_graph): the snapshot is taken there, after the rotation;
* steps' top-k are served from a cache filled at step 0, sliced to the real requests, and the
  worker keeps them uncloned until the loop ends: the `served` check reads them after the last
  step and holds each to its own step's row rule.
"""
from __future__ import annotations

import contextlib
import inspect
import types
import warnings
from typing import Any, Callable

import torch

from harness.engines.after_model import next_token, selected_row
from harness.engines.lanes import LiveBatch
from harness.engines.sglang.config import EngineConfig
from harness.engines.sglang.errors import EngineAdapterError, MissingEngineAttribute
from harness.engines.sglang.graph import DP_CALLS, AttnRecorder
from harness.engines.sglang.handle import ONE_GRAPH, RunnerHandle, write_outputs
from harness.engines.sglang.loader import Engine
from harness.engines.sglang.standins import patched
from harness.verdict import Verdict
from runners.parallel.layout import ParallelLayout

CLASS = "OneGraphMultiLayerEagleMultiStepDraftExtendCudaGraphRunner"
FLAG = "SGLANG_ENABLE_SINGLE_CG_DRAFT"
# Buffers the capture may leave changed, each with why: the rest are inputs the restore must give back.
NOT_RESTORED = {
    "global_num_tokens_gpu": "each bucket's get_forward_batch writes its own DP counts before the capture",
    "global_num_tokens_for_logprob_gpu": "each bucket's get_forward_batch writes its own DP counts before the capture",
    "next_token_logits_buffer": "an output of the graph",
    "draft_probs": "an output of the graph",
}


def available(engine: Engine) -> bool:
    return engine.generation == "prepare" and hasattr(engine.modules["ml"], CLASS)


def flag_on(engine: Engine) -> bool:
    env = engine.modules.get("environ")
    var = getattr(getattr(env, "envs", None), FLAG, None)
    return var is not None and bool(var.get())


def selects_one_graph(engine: Engine, backends: list[AttnRecorder]) -> bool:
    """The worker's choice (multi_layer_eagle_worker_v2._capture_cuda_graphs; the worker module itself pulls in the
    scheduler, so its rule is applied here to the release's own flag and the backends' own answers)."""
    return available(engine) and flag_on(engine) and all(
        b.draft_extend_metadata_captured_in_graph() or getattr(b, "supports_draft_extend_metadata_staging", False) for b in backends)


def prepare(composite: Any, fb: Any) -> None:
    """The composite's prepare() as the worker calls it when nothing was staged (the keyword exists from 0.5.20 on)."""
    if "staged" in inspect.signature(composite.prepare).parameters:
        composite.prepare(fb, staged=False)
    else:
        composite.prepare(fb)


def _inputs(buffers: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in vars(buffers).items() if isinstance(v, torch.Tensor) and k not in NOT_RESTORED}


class OneGraphBackend:
    """Stands in for the decode graph backend the one graph is captured and launched through."""

    def __init__(self, owner: "OneGraph") -> None:
        self.owner = owner
        self.outputs: dict[int, list[Any]] = {}
        self._bodies: dict[int, Callable] = {}

    def capture_one(self, shape_key: Any, run_once: Callable, *args: Any, **kwargs: Any) -> None:
        bs = int(shape_key.size)
        DP_CALLS.clear()
        try:
            outs = run_once()  # the warm-up: every step's body with the stand-in model, the rotations between
        finally:
            DP_CALLS.clear()
        missing = [h.step for h in self.owner.handles if bs not in h.captures]
        if missing or not isinstance(outs, list) or len(outs) != len(self.owner.handles):
            raise EngineAdapterError(f"sglang {self.owner.engine.version}: the one graph's capture of bucket {bs} did not run every step's "
                                     f"body (steps without a model call: {missing})")
        self._bodies[bs], self.outputs[bs] = run_once, outs

    def replay(self, shape_key: Any, *args: Any) -> list[Any]:
        bs, handles = int(shape_key.size), self.owner.handles
        if not handles[0].drive_body:  # as the per-step path: steps > 0 see step 0's buffers, the outputs stay as they were
            for h in handles:
                h.snapshot(bs)
            return self.outputs[bs]
        before = [len(h.snapshots) for h in handles]
        for h in handles:
            h.attn.in_graph_hook = lambda fb, h=h: h.snapshot(bs)
            h.replaying = True
        try:
            outs = self._bodies[bs]()
        finally:
            for h in handles:
                h.attn.in_graph_hook, h.replaying = None, False
            DP_CALLS.clear()
        for h, n, ret, out in zip(handles, before, outs, self.outputs[bs], strict=True):
            if len(h.snapshots) != n + 1:
                raise EngineAdapterError(f"sglang {self.owner.engine.version}: step {h.step} of the one graph refreshed its metadata "
                                         f"{len(h.snapshots) - n} times in one replay (init_forward_metadata_in_graph)")
            h.last_body = (ret, h.snapshots[-1].lanes["input_ids"])
            write_outputs(out, ret)
        return self.outputs[bs]

    def can_run(self, forward_batch: Any, key: Any) -> bool:
        return int(getattr(key, "size", key)) in self.outputs

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise MissingEngineAttribute(f"the engine read its graph backend's {name}, which the adapter's one-graph backend does not provide")


class OneGraph:
    """The one-graph composite of one rank, built through its own _init_and_capture, and its replay as the worker drives it."""

    def __init__(self, engine: Engine, layout: ParallelLayout, tp_rank: int, cfg: EngineConfig, composite: Any,
                 backends: list[AttnRecorder]) -> None:
        self.engine, self.layout, self.tp_rank, self.cfg, self.composite = engine, layout, tp_rank, cfg, composite
        self.handles: list[RunnerHandle] = []
        self.backend = OneGraphBackend(self)
        self.restore: dict[int, list[tuple[str, int, int, int]]] = {}  # bs -> (buffer, index, before, after) the capture changed
        self.checked_buffers: list[str] = []
        self.served: list[list[int]] = []  # the last replay's top-1 per step, as the worker held them after the loop
        ml, cls = engine.modules["ml"], type(composite)

        def resolve(runner: Any) -> OneGraphBackend:
            h = RunnerHandle(engine, ONE_GRAPH, runner.step, runner, backends[runner.step], layout, cfg)
            h.bind_model()
            self.handles.append(h)
            return self.backend

        def capture_one_graph(bs: int, runners: list) -> None:
            before = _inputs(composite.buffers)
            cls._capture_one_graph(composite, bs, runners)
            after = _inputs(composite.buffers)
            self.checked_buffers = sorted(before)
            self.restore[bs] = []
            for name in self.checked_buffers:
                diff = (before[name] != after[name]).reshape(-1).nonzero()
                if len(diff):
                    i = int(diff[0])
                    self.restore[bs].append((name, i, int(before[name].reshape(-1)[i]), int(after[name].reshape(-1)[i])))

        vars(composite)["_capture_one_graph"] = capture_one_graph
        with contextlib.ExitStack() as stack:
            stack.enter_context(patched(ml, "resolve_decode_backend", resolve, engine.version, "the graph backend"))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                composite._init_and_capture()
        del vars(composite)["_capture_one_graph"]
        if [h.step for h in self.handles] != list(range(cfg.num_steps)):
            raise EngineAdapterError(f"sglang {engine.version}: the one-graph composite built runners for steps {[h.step for h in self.handles]}")
        for h in self.handles:
            h.base_width = self.handles[0].tokens_per_bs

    def replay(self, live: LiveBatch, fb: Any) -> list[tuple]:
        """prepare(), then replay(step) for every step as the worker calls them; our records per step."""
        comp = self.composite
        if not comp.can_run_graph(fb):
            raise EngineAdapterError(f"sglang {self.engine.version}: the one-graph composite refused a batch of {live.raw_bs} (can_run_graph)")
        # built only off NPU (`if not _is_npu`), so prepare() fills with the Triton kernel here, never the native twin;
        # the replays' snapshots name that path
        with self.engine.fill.kernel_alone() if self.engine.fill is not None else contextlib.nullcontext():
            prepare(comp, fb)
            served = [comp.replay(step)[2] for step in range(len(self.handles))]
        self.served = [[int(x) for x in t[:, 0].tolist()] for t in served]  # read after the loop: the worker clones none of them
        out = []
        for h in self.handles:
            # the one graph hands no metadata view out (its backend refreshes in the graph): the sum prepare() computed instead
            h.attn.last_replay_view = types.SimpleNamespace(seq_lens_sum=comp.seq_lens_sum)
            rec, _rows, lanes = h.record(live, None)
            body = None
            if h.last_body is not None and h.last_logits is not None:
                pruned = h.capture_rows[rec.bs][0] == rec.bs and h.tokens_per_bs != 1
                body = h.body_record(live, h.last_logits[: live.raw_bs if pruned else live.raw_bs * h.tokens_per_bs])
                body.rotated = h.step > 0  # rotated inside the graph, before this step's launch
            out.append((rec, None, lanes, body))
        return out


def check_served(v: Verdict, step: int, served: list[int], body: Any, ncd: list[int], where: dict) -> None:
    """Step `step`'s top-1 as replay(step) served it: one row per real request, each the top-1 of that step's own row rule
    (after_model.py) on the input_ids that step launched with (body: its BodyRecord, None where the body was not driven)."""
    v.expect_equal("padding", "served top-k rows", where, len(ncd), len(served),
                   "replay(step) serves the real requests' top-k only: the worker concatenates every row it is handed")
    if body is None:
        return
    W, W0 = body.tokens_per_bs, body.base_width
    want = [next_token(body.input_ids[selected_row(i, ncd[i], W, W0, step)]) for i in range(len(ncd))]
    v.checked += 1
    got = served[: len(want)]
    if got != want:
        i = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), len(got))
        v.fail("served", "topk_index", {**where, "request": i}, want[i], got[i] if i < len(got) else "absent",
               f"the top-1 replay({step}) served for request {i}, read after the last step: step {step}'s own, from the input_ids it launched with")


def check_restore(line: Callable[[str, int, int], Any], og: OneGraph, where: dict) -> None:
    """The capture's snapshot / restore: every input buffer as it was before the bucket's capture (on step 0's line of the bucket)."""
    for bs, changed in og.restore.items():
        v = line(ONE_GRAPH, 0, bs).verdict
        v.checked += len(og.checked_buffers)
        for name, i, before, after in changed:
            v.fail("restore", name, {**where, "bs": bs, "index": i}, before, after,
                   "the buffer after the one graph's capture vs before it: the warm-up runs every step and rotates the chain, "
                   "so the composite must restore what it changed, or the first replay starts from a rotated state prepare() "
                   "does not overwrite (its padded lanes, the rows past the live tokens)")
