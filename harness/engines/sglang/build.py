"""Build all draft-extend graph runners of one rank of one layout from the engine's own classes, and drive their replays.

The worker and model runner are strict stand-ins (standins.Strict) carrying the attributes
the runner code reads; __init__ and the composite's _init_and_capture are the engine's, with
the graph capture loop left out (each bucket is captured through RunnerHandle.capture_all).
Between multi-layer steps the draft chain advances: inside the graph where the step windows
grow (assign_new_state, run where the step body is driven), or on the worker in the releases
with one window for all steps (0.5.15 on): the worker's rotate_input_ids over the composite's
shared buffers, run here as the worker calls it wherever the step body is driven (it needs the
step's top-k). Elsewhere steps > 0 are replayed with step 0's token buffers. From 0.5.16 the
worker builds one of two composites by its attention backend's answer; both are built here, the
per-step one for backends planning out of graph and the one graph (one_graph.py) for the others.
"""
from __future__ import annotations

import contextlib
import inspect
import types
import warnings
from typing import Any, Callable, Optional

import torch

from harness.engines.after_model import BodyRecord
from harness.engines.lanes import LaneRecord, LiveBatch
from harness.engines.sglang.config import EngineConfig
from harness.engines.sglang.errors import EngineAdapterError
from harness.engines.sglang.fill import WORKER_ROTATE
from harness.engines.sglang.graph import AttnRecorder, ModelProbe
from harness.engines.sglang.handle import RunnerHandle
from harness.engines.sglang.loader import Engine, attn_backend_class
from harness.engines.sglang.one_graph import CLASS as ONE_GRAPH_CLASS
from harness.engines.sglang.one_graph import OneGraph, available, prepare, selects_one_graph
from harness.engines.sglang.process import configure_process, make_server_args
from harness.engines.sglang.standins import FakeGroup, Strict, noop, patched
from harness.run.records import ReplayRecord
from runners.parallel.layout import ParallelLayout

# one runner's replay: our record, the logits rows it handed back, its lanes per fill path, its body past the model call
Replayed = tuple[ReplayRecord, Optional[int], list[LaneRecord], Optional[BodyRecord]]


class EngineRunners:
    """All draft-extend graph runners of one rank of one layout: multi-layer steps + single-layer."""

    def __init__(self, engine: Engine, layout: ParallelLayout, tp_rank: int, cfg: EngineConfig, one_graph: bool = True) -> None:
        self._configure(engine, layout, tp_rank, cfg)
        sa = self.server_args
        self.multi = self._build_multi_layer(sa)
        self.one_graph = self._build_one_graph(sa) if one_graph else None  # off: the run checks no GPU path, or not this runner
        self.single = self._build_single_layer(sa)

    @classmethod
    def stand_ins(cls, engine: Engine, layout: ParallelLayout, tp_rank: int, cfg: EngineConfig) -> "EngineRunners":
        """The process configured for one rank of a layout and the stand-ins' sources, no runner built: for a runner
        driven on a layout of its own (other_runners.py)."""
        self = cls.__new__(cls)
        self._configure(engine, layout, tp_rank, cfg)
        self.multi, self.one_graph, self.single = [], None, None
        return self

    def _configure(self, engine: Engine, layout: ParallelLayout, tp_rank: int, cfg: EngineConfig) -> None:
        self.engine, self.layout, self.tp_rank, self.cfg = engine, layout, tp_rank, cfg
        sa = make_server_args(engine, layout, cfg)
        configure_process(engine, sa, layout, tp_rank)
        self.server_args = sa
        self._attn_cls = attn_backend_class(engine)
        # what the draft chain's in-graph write (assign_new_state) reads for each request's new front row
        self._hidden_pool = torch.zeros(cfg.max_running_requests + 1, cfg.num_steps, cfg.hidden_size)
        self._req_to_token = 1000 + torch.arange((cfg.max_running_requests + 1) * 64, dtype=torch.int32).view(-1, 64)

    # ---- stand-ins ----
    def _model_runner(self, sa: Any, attn: AttnRecorder) -> Strict:
        cfg = self.cfg
        spec_alg = self.engine.modules["spec_info"].SpeculativeAlgorithm
        hf_config = Strict("model_config.hf_config")
        model_config = Strict("model_config", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, spec_hidden_size=cfg.hidden_size,
                               dtype=torch.float32, hf_config=hf_config, model_is_mrope=False, is_multimodal=False)
        return Strict(
            "model_runner", server_args=sa, device="cpu", gpu_id=0, tp_size=self.layout.tp_size, dp_size=self.layout.dp_size,
            tp_rank=self.tp_rank, model_config=model_config, spec_algorithm=spec_alg.from_string("EAGLE"),
            req_to_token_pool=Strict("req_to_token_pool", size=cfg.max_running_requests, req_to_token=self._req_to_token),
            token_to_kv_pool=Strict("token_to_kv_pool", translate_loc_from_full_to_swa=lambda loc: loc),  # no sliding-window layers
            attn_backend=attn,
            canary_manager=None, device_timer=None, tp_group=FakeGroup("tp", self.layout.tp_size, self.tp_rank),
            kv_index_translator=Strict("kv_index_translator", bind_runner_slots=noop),
            graph_shared_output=Strict("graph_shared_output", get_logits_buffer=lambda vocab, rows: torch.zeros(rows, vocab)),
            model=self._model_stand_in(), model_context=contextlib.nullcontext, war_fastpath_read_done_event=None, dtype=torch.float32,
            ps=self._parallel_sizes(),
        )

    def _parallel_sizes(self) -> Strict:
        """model_runner.ps of 0.5.1x-0.5.2x: the rank's parallel sizes and ranks."""
        lay, r = self.layout, self.tp_rank
        return Strict("model_runner.ps", tp_size=lay.tp_size, tp_rank=r, attn_tp_size=lay.attn_tp_size, attn_tp_rank=lay.attn_tp_rank(r),
                       attn_dp_size=lay.attn_dp_size, attn_dp_rank=lay.attn_dp_rank(r), attn_cp_size=1, attn_cp_rank=0, pp_size=1, pp_rank=0,
                       attn_dcp_size=1, dcp_size=1, moe_ep_size=1, moe_tp_size=lay.tp_size, moe_dp_size=1)

    def _model_stand_in(self) -> ModelProbe:
        """Later releases read the model's shared-experts layout to scope replay: keep the published one."""
        shared = None
        rc = self.engine.modules.get("runtime_context")
        if rc is not None and hasattr(rc, "get_model"):
            shared = getattr(rc.get_model(), "shared_experts", None)
        return ModelProbe(shared)

    def _worker(self, sa: Any, backends: list[AttnRecorder], runners: list[Strict]) -> Strict:
        cfg = self.cfg
        return Strict(
            "eagle_worker", server_args=sa, device="cpu", gpu_id=0, speculative_num_steps=cfg.num_steps,
            speculative_num_draft_tokens=cfg.num_draft_tokens, topk=cfg.topk, draft_extend_attn_backend_list=backends,
            draft_extend_attn_backend=backends[0], mtp_model_runner=lambda step: runners[step], draft_runner=runners[0],
            draft_runner_list=runners, chain_mtp_hidden_states=False, hidden_size=cfg.hidden_size,
            speculative_algorithm=runners[0].spec_algorithm, hot_token_id=None, draft_extend_num_front_tokens=0,
            use_rejection_sampling=False, seed_dsa_topk_from_draft_extend=False, req_to_hidden_states_pool=self._hidden_pool,
            model_config=runners[0].model_config, eagle_use_aux_hidden_state=False,
            target_worker=Strict("target_worker", model_runner=runners[0]),
        )

    def _attn(self, in_graph: bool = False) -> AttnRecorder:
        """The release's attention backend, recording; its req_to_token_pool is what the chain's in-graph write reads.
        in_graph: it answers the worker's probe as FA3 does (draft-extend metadata captured in the graph)."""
        attn = self._attn_cls()
        attn.captures_in_graph = in_graph
        attn.req_to_token_pool = types.SimpleNamespace(req_to_token=self._req_to_token)
        return attn

    # ---- building ----
    def _build_multi_layer(self, sa: Any) -> list[RunnerHandle]:
        eng, ml = self.engine, self.engine.modules["ml"]
        backends = [self._attn() for _ in range(self.cfg.num_steps)]
        mrs = [self._model_runner(sa, b) for b in backends]
        worker = self._worker(sa, backends, mrs)
        Composite = ml.MultiLayerEagleMultiStepDraftExtendCudaGraphRunner
        Runner = ml.MultiLayerEagleDraftExtendCudaGraphRunner
        if available(eng) and selects_one_graph(eng, backends):
            raise EngineAdapterError(f"sglang {eng.version}: the worker would build the one-graph composite for backends that plan out of graph")
        if eng.generation == "prepare":
            comp = self._prepare_composite(Composite, worker, backends)
        else:
            comp = object.__new__(Composite)
            vars(comp).update(eagle_worker=worker, device="cpu", gpu_id=0, speculative_num_steps=self.cfg.num_steps,
                              draft_extend_attn_backend_list=backends, runners=[], cuda_graph_buffers={}, seq_len_fill_value=1,
                              max_bs=1, offsets=[0])
        stack = contextlib.ExitStack()
        with stack:
            stack.enter_context(patched(Runner, "capture", noop, eng.version, "the graph capture loop, left out"))
            if eng.generation != "legacy":
                stack.enter_context(patched(ml, "resolve_decode_backend", lambda runner: None, eng.version, "the graph backend"))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                comp._init_and_capture()
        self.composite = comp
        handles = []
        for step, runner in enumerate(comp.runners):
            if runner is None:
                raise EngineAdapterError(f"sglang {eng.version}: the composite built no runner for step {step}")
            h = RunnerHandle(eng, "multi_layer", step, runner, backends[step], self.layout, self.cfg)
            h.install_graph_stand_ins()
            handles.append(h)
        for h in handles:
            h.base_width = handles[0].tokens_per_bs
        for h in reversed(handles):  # the engine captures the last step first
            h.capture_all()
        return handles

    def _prepare_composite(self, cls: type, worker: Strict, backends: list[AttnRecorder]) -> Any:
        """A composite of the prepare generation with __init__'s fields; its _init_and_capture is left to the caller."""
        comp = object.__new__(cls)
        vars(comp).update(eagle_worker=worker, device="cpu", gpu_id=0, speculative_num_steps=self.cfg.num_steps,
                          draft_extend_attn_backend_list=backends, runners=[], seq_len_fill_value=1, max_bs=1,
                          captured_req_width=1, num_front_tokens=0, prune_draft_extend_logits=False,
                          _out_cache_loc_virtual=None, _kv_loc_plan=None, _kv_loc_cols=None)
        return comp

    def _build_one_graph(self, sa: Any) -> Optional[OneGraph]:
        """The one-graph composite, where the worker would build it for backends that capture their metadata in the graph."""
        eng = self.engine
        if not available(eng):
            return None
        backends = [self._attn(in_graph=True) for _ in range(self.cfg.num_steps)]
        if not selects_one_graph(eng, backends):
            return None
        worker = self._worker(sa, backends, [self._model_runner(sa, b) for b in backends])
        comp = self._prepare_composite(getattr(eng.modules["ml"], ONE_GRAPH_CLASS), worker, backends)
        return OneGraph(eng, self.layout, self.tp_rank, self.cfg, comp, backends)

    def _build_single_layer(self, sa: Any) -> RunnerHandle:
        eng, sl = self.engine, self.engine.modules["sl"]
        attn = self._attn()
        mr = self._model_runner(sa, attn)
        worker = self._worker(sa, [attn], [mr])
        Runner = sl.EAGLEDraftExtendCudaGraphRunner
        runner = object.__new__(Runner)
        # __init__ ends by capturing: leave that out (per instance), and give the graph backend a stand-in
        vars(runner)["capture"] = noop
        with contextlib.ExitStack() as stack:
            if eng.generation != "legacy":
                stack.enter_context(patched(sl, "resolve_decode_backend", lambda r: None, eng.version, "the graph backend"))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                Runner.__init__(runner, worker)
        del vars(runner)["capture"]
        h = RunnerHandle(eng, "single_layer", 0, runner, attn, self.layout, self.cfg)
        h.install_graph_stand_ins()
        h.capture_all()
        return h

    @property
    def handles(self) -> list[RunnerHandle]:
        return [*self.multi, *(self.one_graph.handles if self.one_graph else []), self.single]

    # ---- live batches ----
    def _forward_batch(self, live: LiveBatch, T: int) -> Any:
        fbi = self.engine.modules["fbi"]
        raw, n = live.raw_bs, live.raw_bs * T
        seq_lens = torch.tensor(live.seq_lens, dtype=torch.int64)
        accept = torch.tensor(live.accept_lens, dtype=torch.int32)
        spec = types.SimpleNamespace(
            hidden_states=torch.zeros(n, self.cfg.hidden_size), num_correct_drafts=accept - 1, num_accept_tokens=accept,
            num_accepted_drafts=accept - 1, num_accepted_tokens=accept, accept_length=accept,  # the same, as 0.5.11 / up to 0.5.10 name them
            num_tokens_per_req=T, num_tokens_for_logprob_per_req=1, positions=None, select_index=None,
            extend_seq_lens_cpu=None, extend_seq_lens_tensor=None,
        )
        dp_sizes = list(live.dp_batch_sizes)
        tok = {k: torch.tensor(v, dtype=torch.int64) for k, v in live.tokens(T).items()}
        fb = fbi.ForwardBatch(
            forward_mode=fbi.ForwardMode.DRAFT_EXTEND_V2, batch_size=raw, input_ids=tok["input_ids"],
            req_pool_indices=torch.tensor(live.req_pool_indices, dtype=torch.int64), seq_lens=seq_lens, out_cache_loc=tok["out_cache_loc"],
            seq_lens_sum=int(seq_lens.sum()),
        )
        extra = dict(
            seq_lens_cpu=seq_lens.clone(), positions=tok["positions"], spec_info=spec,
            extend_seq_lens=torch.full((raw,), T, dtype=torch.int32), extend_start_loc=torch.arange(raw, dtype=torch.int32) * T,
            extend_seq_lens_cpu=[T] * raw, extend_num_tokens=n,
            original_global_num_tokens_cpu=dp_sizes, global_num_tokens_cpu=[b * T for b in dp_sizes],
            global_num_tokens_for_logprob_cpu=[b * T for b in dp_sizes],
            can_run_dp_cuda_graph=True, can_run_decode_cuda_graph=True,
        )
        for k, v in extra.items():
            setattr(fb, k, v)
        return fb

    def replay_multi_layer(self, live: LiveBatch) -> list[Replayed]:
        """One decode iteration of the multi-layer draft-extend through the per-step composite, as the worker drives it."""
        eng, comp = self.engine, self.composite
        T0 = self.multi[0].tokens_per_bs
        fb = self._forward_batch(live, T0)
        out = []
        if eng.generation == "prepare":
            if not comp.can_run_graph(fb):
                raise EngineAdapterError(f"sglang {eng.version}: the multi-layer composite refused a batch of {live.raw_bs} (can_run_graph)")
            prepare(comp, fb)
            rotate, rotated = self._worker_rotate(), False
            for step, h in enumerate(self.multi):
                logits, _p, topk_index = comp.replay(step)
                out.append(self._records(h, live, logits.next_token_logits))
                body = out[-1][3]
                if body is not None:
                    body.rotated = rotated
                rotated = rotate is not None and body is not None and step < len(self.multi) - 1
                if rotated:  # the worker, between steps: step + 1's graph reads the rotated window
                    b = comp.buffers
                    rotate(b.input_ids[: comp.raw_num_tokens], b.extend_start_loc[: comp.raw_bs], b.extend_seq_lens[: comp.raw_bs],
                           topk_index, b.select_index[: comp.raw_bs])
            return out
        can_run = comp.can_run(fb) if eng.generation == "legacy" else comp.can_run_graph(fb)
        if not can_run:
            raise EngineAdapterError(f"sglang {eng.version}: the multi-layer composite refused a batch of {live.raw_bs} (can_run)")
        result = types.SimpleNamespace(accept_lens=fb.spec_info.num_accept_tokens.clone())
        comp.reset_buffers(fb, result)
        for step, h in enumerate(self.multi):
            run = h.runner.replay if eng.generation == "legacy" else h.runner.execute
            res = run(fb, init_state=(step == 0))
            out.append(self._records(h, live, res.next_token_logits))
        return out

    def replay_one_graph(self, live: LiveBatch) -> list[Replayed]:
        """The same iteration through the one-graph composite (0.5.16 on, where built): prepare and every step in one replay."""
        if self.one_graph is None:
            return []
        return self.one_graph.replay(live, self._forward_batch(live, self.one_graph.handles[0].tokens_per_bs))

    def _worker_rotate(self) -> Optional[Callable]:
        """The worker's chain advance between steps; None where the composite rotates inside its graph (the one graph,
        one_graph.py, driven on its own)."""
        if getattr(self.composite, "rotates_in_graph", False):
            return None
        utils = self.engine.modules["mle_utils"]
        fn = next((getattr(utils, n) for n in WORKER_ROTATE if hasattr(utils, n)), None)
        if fn is None:
            raise EngineAdapterError(f"sglang {self.engine.version}: {utils.__name__} has none of {', '.join(WORKER_ROTATE)}, the "
                                     "worker's draft-chain advance between multi-layer steps: the release moved it")
        return fn

    def replay_single_layer(self, live: LiveBatch) -> Replayed:
        eng, h = self.engine, self.single
        T = h.tokens_per_bs
        fb = self._forward_batch(live, T)
        r = h.runner
        can_run = r.can_run(fb) if eng.generation == "legacy" else r.can_run_graph(fb)
        if not can_run:
            raise EngineAdapterError(f"sglang {eng.version}: the single-layer runner refused a batch of {live.raw_bs} (can_run)")
        if eng.generation == "legacy":
            res = r.replay(fb)
        elif "select_index" in inspect.signature(r.execute).parameters:
            # later releases hand the worker's select_index (each request's last accepted row) to execute
            accept = fb.spec_info.num_accept_tokens.to(torch.int64)
            select_index = torch.arange(live.raw_bs, dtype=torch.int64) * T + accept - 1
            res = r.execute(fb, select_index)
        else:
            res = r.execute(fb)
        return self._records(h, live, res.next_token_logits)

    @staticmethod
    def _records(h: RunnerHandle, live: LiveBatch, logits: torch.Tensor) -> Replayed:
        rec, returned, lanes = h.record(live, int(logits.shape[0]))
        return rec, returned, lanes, h.body_record(live, logits)
