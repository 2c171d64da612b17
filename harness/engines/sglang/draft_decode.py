"""SGLang's graphed single-layer EAGLE draft decode (EAGLEDraftCudaGraphRunner), driven up to the model call.

The runner's __init__, capture_one_shape (its forward batch, gathered gpu tensors and the
step body's set_dp_buffer_len) and execute (the bucket it picks, the replay fill) are the
engine's; the draft chain itself (eagle_worker.draft_forward) is never run: at capture it
records what the body baked and stops it, and at a replay the graph launch snapshots the
static buffers. DECODE mode counts bs * topk tokens (resolve_num_tokens_per_req's
"draft_decode" width), every one of them a logits row, as our runners.eagle_draft_cuda_graph_runner.

Releases whose runner predates this API (no execute / capture_one_shape, or no
captured_req_width) are not driven: `unsupported()` says why, and the report says n/a.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import types
import warnings
from typing import Any, Optional

import torch

from harness.engines.lanes import LaneRecord, LiveBatch, check_lanes, live_batch, schedule
from harness.engines.sglang.errors import EngineAdapterError
from harness.engines.sglang.graph import (
    FakeGraphBackend,
    recording_set_dp_buffer_len,
    run_until_model,
    stop_at_model,
    tolist,
)
from harness.engines.sglang.handle import RunnerFacts
from harness.engines.sglang.standins import Strict, noop, patched
from harness.props.p1_records import check_replay_record
from harness.run.records import CaptureRecord, ReplayRecord
from runners.parallel.layout import ParallelLayout

MODULE = "sglang.srt.speculative.eagle_draft_cuda_graph_runner"
KIND = "draft_decode"
# the buffers the replay fill writes per request / per token (DECODE: the token buffers are bs * topk wide)
LANES_PER_REQUEST = ("req_pool_indices", "seq_lens")
LANES_PER_TOKEN = ("positions",)


def load(engine: Any) -> tuple[Optional[types.ModuleType], str]:
    """The runner module of this release, or None with the reason it is not driven."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = importlib.import_module(MODULE)
    except Exception as e:  # an import the release needs that our stubs lack: not a verdict
        return None, f"importing {MODULE} raised {type(e).__name__}: {e}"
    cls = getattr(mod, "EAGLEDraftCudaGraphRunner", None)
    missing = [n for n in ("execute", "capture_one_shape", "can_run_graph") if cls is None or not hasattr(cls, n)]
    if missing:
        return None, f"its EAGLEDraftCudaGraphRunner has no {', '.join(missing)} (an older graph-runner API the adapter does not drive)"
    if not hasattr(mod, "set_dp_buffer_len"):
        return None, "the runner module does not call set_dp_buffer_len"
    if not isinstance(mod.set_dp_buffer_len, types.FunctionType) or not hasattr(mod.set_dp_buffer_len, "__wrapped_engine__"):
        mod.set_dp_buffer_len = recording_set_dp_buffer_len(mod.set_dp_buffer_len)
    if hasattr(mod, "maybe_flashinfer_autotune_speculative_draft"):
        mod.maybe_flashinfer_autotune_speculative_draft = noop
    return mod, ""


class DraftAttn:
    """The multi-step draft attention backend: plans nothing, records the batch view it is given at replay."""

    def __init__(self, step_backend: Any) -> None:
        self.attn_backends = [step_backend]
        self.last_replay_view: Any = None

    def init_cuda_graph_state(self, *args: Any, **kwargs: Any) -> None:
        pass

    def init_forward_metadata_in_graph(self, *args: Any, **kwargs: Any) -> None:
        pass

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False, *args: Any, **kwargs: Any) -> None:
        if not in_capture:  # read now: some releases pass the live batch itself and restore its raw sum after the replay
            self.last_replay_view = types.SimpleNamespace(seq_lens_sum=forward_batch.seq_lens_sum, batch_size=forward_batch.batch_size)


class DraftDecodeHandle(RunnerFacts):
    """One rank's EAGLEDraftCudaGraphRunner: built with the draft-extend builder's stand-ins, captured per bucket, replayed."""

    def __init__(self, mod: types.ModuleType, runners: Any) -> None:
        self.mod, self.engine, self.cfg, self.layout = mod, runners.engine, runners.cfg, runners.layout
        self.captures: dict[int, CaptureRecord] = {}
        self._snap: Optional[dict] = None
        step_attn = runners._attn()
        self.attn = DraftAttn(step_attn)
        # the draft decode's own top-k: in the server args (read by releases up to 0.5.18) and the runtime context's spec bag
        replace = getattr(runners.server_args, "replace_resolved", None)  # 0.5.19: a resolved ServerArgs is read-only
        if replace is not None:
            sa = replace("engine-check: the draft decode's top-k", speculative_eagle_topk=self.cfg.draft_decode_topk)
        else:
            sa = copy.copy(runners.server_args)
            sa.speculative_eagle_topk = self.cfg.draft_decode_topk
        mr = runners._model_runner(sa, step_attn)
        worker = runners._worker(sa, [step_attn], [mr])
        vars(worker).update(draft_forward=self._draft_forward, dsa_seed_topk_width=0)
        Runner = mod.EAGLEDraftCudaGraphRunner
        runner = object.__new__(Runner)
        vars(runner)["capture"] = noop  # __init__ ends by capturing every bucket: each is captured below instead
        rc = self.engine.modules.get("runtime_context")
        spec = getattr(rc, "get_spec", None)
        topk_ctx = spec().override(speculative_eagle_topk=self.cfg.draft_decode_topk) if spec is not None else contextlib.nullcontext()
        with patched(mod, "resolve_decode_backend", lambda r: None, self.engine.version, "the graph backend"), topk_ctx:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                Runner.__init__(runner, worker, draft_attn_backend=self.attn)
        del vars(runner)["capture"]
        runner.backend = FakeGraphBackend(self)
        # the MoE dispatch mode switch around capture / replay (a DeepEP buffer, absent here): no token counts involved
        runner.deepep_adapter = Strict("deepep_adapter", capture=noop, replay=noop)
        self.runner = runner
        for bs in reversed(self.capture_bs):
            runner.capture_one_shape(bs, None)
            if bs not in self.captures:
                raise EngineAdapterError(f"sglang {self.engine.version}: capturing bucket {bs} of the draft-decode runner recorded nothing")

    # ---- capture ----
    def _draft_forward(self, fb: Any) -> Any:
        stop_at_model(fb, fb, f"sglang {self.engine.version}: the draft-decode body (draft_forward)")

    def run_body_until_model(self, bs: int, run_once: Any) -> None:
        fb, dp, gpu_tokens, gpu_logprob = run_until_model(run_once, f"sglang {self.engine.version}: the draft-decode capture body for bucket {bs}")
        if int(fb.batch_size) != bs:
            raise EngineAdapterError(f"sglang {self.engine.version}: capturing draft-decode bucket {bs} built a batch of {fb.batch_size}")
        nt = dp.get("global_num_tokens")
        host = {
            "forward_mode": getattr(fb.forward_mode, "name", str(fb.forward_mode)).lower(),
            "batch_size": bs,
            "num_tokens": int(fb.positions.shape[0]),  # DECODE: input_ids is left unset, positions are the token rows
            "global_num_tokens_cpu": None if nt is None else [int(x) for x in nt],
            "global_num_tokens_for_logprob_cpu": None,  # the engine bakes the gpu tensor only
            "global_dp_buffer_len": dp.get("global_dp_buffer_len"),
            "dp_padding_mode": "max_len" if dp.get("dp_max_padding") else "sum_len",
            "local_dp_buffer_len": dp.get("local_dp_buffer_len"),
        }
        self.captures[bs] = CaptureRecord(bs, host["num_tokens"], host, gpu_tokens, gpu_logprob)

    def fake_output(self, bs: int) -> tuple:
        """What the graph's outputs would hold (the draft chain's scores, tokens and parents; never read here)."""
        k = self.tokens_per_bs
        return torch.zeros(bs, k, dtype=torch.int64), torch.zeros(bs, k, dtype=torch.int64), torch.zeros(bs, k, dtype=torch.int64), None

    # ---- replay ----
    def on_replay(self, bs: int) -> None:
        b = self.runner.buffers
        g = b.global_num_tokens_gpu
        self._snap = {"bs": bs, "gpu": tolist(g), "lp": tolist(b.global_num_tokens_for_logprob_gpu), "shape": None if g is None else tuple(g.shape),
                      "seq_lens": tolist(b.seq_lens[:bs]), "lanes": {n: tolist(getattr(b, n)) for n in (*LANES_PER_REQUEST, *LANES_PER_TOKEN)}}

    def _forward_batch(self, live: LiveBatch) -> Any:
        fbi = self.engine.modules["fbi"]
        k, raw = self.tokens_per_bs, live.raw_bs
        seq_lens = torch.tensor(live.seq_lens, dtype=torch.int64)
        tok = live.tokens(k)
        spec = types.SimpleNamespace(topk_p=torch.ones(raw, k), topk_index=torch.zeros(raw, k, dtype=torch.int64), draft_probs=None,
                                     hidden_states=torch.zeros(raw, self.cfg.hidden_size), num_tokens_per_req=k, dsa_topk_indices=None)
        fb = fbi.ForwardBatch(forward_mode=fbi.ForwardMode.DECODE, batch_size=raw, input_ids=None,
                              req_pool_indices=torch.tensor(live.req_pool_indices, dtype=torch.int64), seq_lens=seq_lens,
                              out_cache_loc=torch.tensor(tok["out_cache_loc"] * self.cfg.num_steps, dtype=torch.int64), seq_lens_sum=int(seq_lens.sum()))
        dp_sizes = list(live.dp_batch_sizes)
        extra = dict(seq_lens_cpu=seq_lens.clone(), positions=torch.tensor(tok["positions"], dtype=torch.int64), spec_info=spec,
                     original_global_num_tokens_cpu=dp_sizes, global_num_tokens_cpu=[b * k for b in dp_sizes],
                     can_run_dp_cuda_graph=True, can_run_decode_cuda_graph=True, can_run_dp_draft_cuda_graph=True, sampling_info=None)
        for key, val in extra.items():
            setattr(fb, key, val)
        return fb

    def replay(self, live: LiveBatch) -> tuple[ReplayRecord, LaneRecord]:
        """One draft-decode replay of the live batch, as the worker drives it: can_run_graph, then execute up to the launch."""
        fb = self._forward_batch(live)
        if not self.runner.can_run_graph(fb):
            raise EngineAdapterError(f"sglang {self.engine.version}: the draft-decode runner refused a batch of {live.raw_bs} (can_run_graph)")
        self._snap, self.attn.last_replay_view = None, None
        self.runner.execute(fb)
        s = self._snap
        if s is None:
            raise EngineAdapterError(f"sglang {self.engine.version}: the draft-decode replay never reached the graph")
        cap = self.captures.get(s["bs"])
        if cap is None:
            raise EngineAdapterError(f"sglang {self.engine.version}: draft-decode replay chose bucket {s['bs']}, never captured")
        view = self.attn.last_replay_view
        n = s["bs"] * self.tokens_per_bs
        rec = ReplayRecord(
            runner=KIND, step=0, branch=self.layout.branch.value, raw_bs=live.raw_bs, bs=s["bs"], tokens_per_bs=self.tokens_per_bs,
            capture=cap, global_num_tokens_gpu=s["gpu"], global_num_tokens_for_logprob_gpu=s["lp"], gpu_shape=s["shape"],
            padded_seq_lens=s["seq_lens"][live.raw_bs:], seq_lens_sum=None if view is None else int(view.seq_lens_sum),
            seq_lens_sum_actual=sum(s["seq_lens"]), rows_fed=n, logits_rows=n, captured_bs=self.capture_bs,
        )
        return rec, LaneRecord(KIND, 0, "", live.raw_bs, s["bs"], self.tokens_per_bs, s["lanes"])


def check(dd: DraftDecodeHandle, layout: ParallelLayout, d: int, tp_rank: int, line, filled: frozenset[str]) -> None:
    """P1 and the padded lanes of the engine's graphed draft decode: DECODE counts bs * topk tokens, a logits row each
    (as runners.eagle_draft_cuda_graph_runner, harness.props.p1_metadata's draft-decode check), so for_logprob == num_tokens."""
    k, cfg, seen = dd.tokens_per_bs, dd.cfg, {}
    for it, dp_sizes in enumerate(schedule(layout, dd.capture_bs)):
        raw = dp_sizes[d]
        needed = max(dp_sizes) if layout.require_mlp_tp_gather else raw
        live = live_batch(raw, dp_sizes, it, cfg.num_draft_tokens, cfg.max_running_requests)
        rec, lanes = dd.replay(live)
        ln = line(KIND, 0, rec.bs)
        ln.raw_bs.add(raw)
        ln.ranks.add(tp_rank)
        ln.tokens_per_bs = k
        check_replay_record(ln.verdict, layout, rec, tp_rank, it, needed, require_host_lists=False)
        w = {"layout": layout.describe(), "branch": layout.branch.value, "runner": KIND, "step": 0, "rank": tp_rank,
             "iteration": it, "raw_bs": raw, "bs": rec.bs}
        check_lanes(ln.verdict, lanes, live, seen, w, filled)
