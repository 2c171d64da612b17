"""Drive vLLM's EAGLE proposer CUDA-graph path for one DP world, without a model or a GPU.

Per DP rank: an EagleSpeculator whose graph managers come from its own
init_cudagraph_manager and are captured by its own capture() (the draft model's forward is a
recorder: what a capture pass bakes is the graph's bake; a draft step's body around it is the
engine's, with a next-id model and sampler standing in), and the target's
uniform-decode graph manager, whose DP agreement the proposer reuses. Per iteration of the
schedule, every rank at once (one thread each) runs the engine's dispatch_cg_and_sync_dp for
the target (the collective that pads every rank to one count); then every rank at once runs
the proposer's own propose() on that agreement: its prefill-input kernel, the draft prefill
dispatch and replay, the decode-input kernel, the decode dispatch (a collective of its own up to
0.29, the reused agreement after) and the K - 1 draft decode steps with their slot mappings.
The configuration and the target's manager follow the release's capture API (api.py). Everything is converted into ReplayRecord / CaptureRecord.

The draft decode has two paths, and the release picks one from its attention backends
(_configure_decode_metadata_update): a per-step loop (runner draft_decode: one graph per step,
slot mappings and metadata rebuilt on the host between steps) or, where every backend can
update draft-decode metadata in place, one graph holding all K - 1 steps with those refreshes
recorded inside it (runner draft_decode_fused). A DP world is driven once per path, the
draft's attention group saying whether it supports the update; the path is the release's
answer to that, never set here.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from harness.engines.sglang.errors import EngineAdapterError
from harness.engines.vllm.config import VllmCheckConfig
from harness.engines.vllm.loader import VllmEngine
from harness.engines.vllm.standins import (
    DPWorld,
    DraftAttnGroup,
    FakeGraph,
    ModelStateStandIn,
    Strict,
    build_metadata,
    config_standin,
    graph_body,
    next_id_model,
    next_id_sampler,
)
from harness.run.records import CaptureRecord, ReplayRecord

RUNNERS = ("target_verify", "draft_prefill", "draft_decode", "draft_decode_fused")
DECODE_RUNNERS = RUNNERS[2:]  # the per-step loop, the fused multi-step graph
# How a release chooses the fused path from its attention groups, and the flag it sets (newest first)
DECODE_PATH_CHOICE = (("_configure_decode_metadata_update", "supports_decode_metadata_update"),
                      ("_configure_fused_multi_step_decode", "use_fused_multi_step_decode"))
# What propose() calls to run the K - 1 steps, per path (the first the release has): up to 0.33 the fused run is
# _fused_multi_step_decode, which 0.34 renamed _run_fused_multi_step_decode (its graph body took the old name)
DECODE_RUNS = (("_multi_step_decode",), ("_run_fused_multi_step_decode", "_fused_multi_step_decode"))
# The draft step's body, the engine's own: _decode from 0.34, _generate_draft before
DRAFT_STEP_BODIES = ("_decode", "_generate_draft")
# How the draft decode builds its attention metadata: _build_uniform_attn_metadata from 0.30, _build_draft_attn_metadata before
UNIFORM_ATTN_BUILDERS = ("_build_uniform_attn_metadata", "_build_draft_attn_metadata")
# propose()'s argument taking the target's DP agreement (newest first); up to 0.28 propose() has UNPASSED_DP_ARG, which
# GPUModelRunner never passes: each of its dispatches runs its own collective
DP_ARGS = ("dp_sync_state", "dp_sync")
UNPASSED_DP_ARG = "num_tokens_across_dp"
LANE_BUFFERS = ("input_ids", "positions", "query_start_loc", "seq_lens")
KV_BLOCK_SIZE = 16


@dataclass
class VllmReplay:
    """One replay on one rank: our record plus what only vLLM has (the graph mode, the lanes)."""

    rec: ReplayRecord
    cg_mode: str  # FULL / PIECEWISE / NONE (eager)
    rank: int
    iteration: int
    dp_raw: list[int]  # raw requests per DP rank this iteration
    lanes: Optional[dict[str, list[int]]] = None  # the decode input buffers the first draft step's forward read
    live: Optional[dict[str, list[int]]] = None  # what this rank's real lanes were given
    steps: list[dict] = field(default_factory=list)  # per draft forward: its step, token count, lanes, the metadata's derivation


@dataclass
class RankCapture:
    """One rank's captured graphs per runner: (descriptor, graph with its bake), by token count; and
    the token counts of its PIECEWISE captures (no graph object: the compiled model holds them)."""

    graphs: dict[str, list[tuple[Any, FakeGraph]]] = field(default_factory=dict)
    piecewise: dict[str, list[int]] = field(default_factory=dict)


def vllm_config(engine: VllmEngine, cfg: VllmCheckConfig, dp_size: int, dp_rank: int) -> Strict:
    comp = engine.modules["compilation"]
    spec = Strict("speculative_config", method="eagle", num_speculative_tokens=cfg.num_speculative_tokens,
                  num_speculative_tokens_per_batch_size=None,
                  uses_dynamic_speculative_decoding=lambda: False, use_multi_module_mtp=lambda: False, use_gemma4_mtp=lambda: False)
    config_cls = engine.attr("config", "VllmConfig")
    vcfg = config_standin(
        config_cls, engine.api.bound,
        num_speculative_tokens=cfg.num_speculative_tokens, speculative_config=spec,
        compilation_config=engine.api.compilation(comp.CUDAGraphMode.FULL_AND_PIECEWISE, cfg),
        scheduler_config=Strict("scheduler_config", max_num_seqs=cfg.max_num_seqs,
                                max_num_batched_tokens=cfg.max_num_seqs * (1 + cfg.num_speculative_tokens)),
        parallel_config=Strict("parallel_config", tensor_parallel_size=1, data_parallel_size=dp_size, data_parallel_rank=dp_rank,
                               enable_fault_tolerance=False),
        cache_config=Strict("cache_config", use_kda_recoverssm=False),
        model_config=Strict("model_config", max_model_len=cfg.max_model_len, enforce_eager=False),
    )
    engine.api.settle(config_cls, engine.attr("compilation", "CompilationConfig"), vcfg)
    return vcfg


class RankDriver:
    """One DP rank: its EagleSpeculator (engine methods, stand-in state) and the target's manager."""

    def __init__(self, engine: VllmEngine, cfg: VllmCheckConfig, dp_size: int, rank: int, fused: bool) -> None:
        self.engine, self.cfg, self.dp_size, self.rank, self.fused = engine, cfg, dp_size, rank, fused
        self.decode_runner = DECODE_RUNNERS[fused]
        self.attn_group = DraftAttnGroup(supports_update=fused)
        self.steps: list[dict] = []  # the draft decode forwards of the propose() now running
        self.vcfg = vllm_config(engine, cfg, dp_size, rank)
        self.mode = engine.modules["compilation"].CUDAGraphMode
        self.K = cfg.num_speculative_tokens
        self.q = 1 + self.K
        self.live: Optional[dict[str, list[int]]] = None  # the batch propose() now runs (the draft prefill's outputs)
        self.spec = self._speculator()
        self._choose_decode_path()
        self.spec.init_cudagraph_manager(self.mode.FULL_AND_PIECEWISE)
        for mgr in (self.spec.prefill_cudagraph_manager, self.spec.decode_cudagraph_manager):
            mgr.capture = self._capturing_bodies(mgr.capture)
        cgm = engine.attr("cg", "CudaGraphManager")
        self.target = cgm(self.vcfg, torch.device("cpu"), self.mode.FULL_AND_PIECEWISE, **engine.api.target_manager_kwargs(self.vcfg))
        self.decode_calls: list[tuple] = []
        # propose()'s DP agreement argument: dp_sync up to 0.31, dp_sync_state after; none up to 0.28 (UNPASSED_DP_ARG)
        params = inspect.signature(self.spec.propose).parameters
        names = [n for n in DP_ARGS if n in params]
        if not names and UNPASSED_DP_ARG not in params:
            raise EngineAdapterError(f"vllm {engine.version}: propose() takes none of {', '.join(DP_ARGS)} nor {UNPASSED_DP_ARG}; "
                                     "teach drive.py its DP argument")
        self.sync_arg: Optional[str] = names[0] if names else None

    def _speculator(self) -> Any:
        eagle = self.engine.attr("eagle", "EagleSpeculator")
        ib = self.engine.attr("input_batch", "InputBuffers")
        n, max_tokens = self.cfg.max_num_seqs, self.cfg.max_num_seqs * self.q
        body = next((n for n in DRAFT_STEP_BODIES if hasattr(eagle, n)), None)
        if body is None:
            raise EngineAdapterError(f"vllm {self.engine.version}: the speculator has none of {', '.join(DRAFT_STEP_BODIES)}; "
                                     "teach drive.py its draft step")
        # the draft step is the engine's own body (its forward, its sampling, update_draft_inputs for the next step), entered
        # through the recorder; only the model forward and the sampling inside it stand in
        step = _recorder(self.engine, self._draft_step, getattr(eagle, body))
        attn = next((n for n in UNIFORM_ATTN_BUILDERS if hasattr(eagle, n)), None)
        if attn is None:
            raise EngineAdapterError(f"vllm {self.engine.version}: the speculator has none of {', '.join(UNIFORM_ATTN_BUILDERS)}; "
                                     "teach drive.py how its draft decode builds attention metadata")
        # the draft prefill's outputs are written when the release's on_prefill_end hook fires (from 0.28), else when its
        # forward runs (eager, or inside a replayed graph)
        hooked = hasattr(eagle, "on_prefill_end")
        prefill = _recorder(self.engine, None if hooked else self._prefill_outputs)
        cls = type("EngineCheckEagleSpeculator", (eagle,), {"_prefill": prefill, body: step, "_run_model": next_id_model,
                                                            "sample_draft": next_id_sampler, attn: self._uniform_attn_metadata})
        s = object.__new__(cls)  # the engine's __init__ builds the draft model's state; the fields the paths read are set here
        s.__dict__.update(
            vllm_config=self.vcfg, device=torch.device("cpu"), speculative_config=self.vcfg.speculative_config, method="eagle",
            num_speculative_steps=self.K, max_num_reqs=n, max_num_tokens=max_tokens, draft_max_seq_len=self.cfg.max_model_len,
            dp_size=self.dp_size, dp_rank=self.rank, enable_adaptive_verification=False,
            input_buffers=ib(n, max_tokens, torch.device("cpu")), target_input_buffers=ib(n, max_tokens, torch.device("cpu")),
            can_reuse_target_attn_metadata=True, target_attn_groups=[], attn_groups=[[self.attn_group]], model_state=ModelStateStandIn(),
            block_tables=self._block_tables(),
            kv_cache_config=None, model=None, pcp_manager=None, eplb_state=None, supports_mm_inputs=False,
            hidden_states=torch.zeros(max_tokens, 1), temperature=torch.zeros(n), seeds=torch.zeros(n, dtype=torch.int64),
            last_token_indices=torch.zeros(n, dtype=torch.int64), current_draft_step=torch.tensor(0, dtype=torch.int64),
            idx_mapping=torch.zeros(n, dtype=torch.int64), draft_tokens=torch.zeros(n, self.K, dtype=torch.int64),
            sample_src_positions=torch.zeros(n, dtype=torch.int64), draft_logits=None,
            max_model_len_gpu=torch.tensor(self.cfg.max_model_len, dtype=torch.int32),  # from 0.34: update_draft_inputs' clamp
        )
        if not isinstance(getattr(cls, "max_model_len", None), property):  # a plain field before 0.33's property
            s.max_model_len = self.cfg.max_model_len
        if hooked:
            s.on_prefill_end = self._prefill_outputs
        name = next(n for n in DECODE_RUNS[self.fused] if hasattr(s, n))
        inner = getattr(s, name)

        def multi_step_decode(num_reqs, skip_attn, batch_desc, num_tokens_across_dp, *rest):
            self.decode_calls.append((num_reqs, batch_desc, None if num_tokens_across_dp is None else num_tokens_across_dp.tolist()))
            return inner(num_reqs, skip_attn, batch_desc, num_tokens_across_dp, *rest)

        setattr(s, name, multi_step_decode)
        return s

    def _choose_decode_path(self) -> None:
        """The release's own choice (set_attn calls it once the attention groups exist), checked to be the path asked for;
        a release with only the per-step loop (decode_paths) makes none."""
        if decode_paths(self.engine) == (False,) and not self.fused:
            return
        for configure, flag in DECODE_PATH_CHOICE:
            if hasattr(self.spec, configure):
                getattr(self.spec, configure)()
                if getattr(self.spec, flag) != self.fused:
                    raise EngineAdapterError(f"vllm {self.engine.version}: {configure}() set {flag}={getattr(self.spec, flag)} for a draft "
                                             f"attention group whose supports_draft_decode_metadata_update is {self.fused}")
                return
        raise EngineAdapterError(f"vllm {self.engine.version}: the speculator has none of {', '.join(c for c, _ in DECODE_PATH_CHOICE)}; "
                                 "teach drive.py how it picks the draft decode path")

    def _capturing_bodies(self, capture: Any) -> Any:
        """A speculator manager's capture whose forward function, called inside a graph's capture, is that graph's body."""

        def capture_with_bodies(forward_fn: Any, *args: Any, **kwargs: Any) -> Any:
            return capture(graph_body(self.engine.capture, forward_fn), *args, **kwargs)

        return capture_with_bodies

    def _uniform_attn_metadata(self, num_reqs: int, batch_desc: Any = None, num_reqs_padded: Optional[int] = None,
                               **kwargs: Any) -> dict[str, Any]:
        """The draft decode's metadata build: the groups' metadata over the padded requests (batch_desc.num_reqs or num_reqs, as
        the engine's _build_attn_metadata sizes it; up to 0.29 the caller passes that count as num_reqs_padded) of the draft
        buffers; the host-side build of the per-step loop and of the fused path's eager step 1."""
        n, spec = num_reqs_padded or batch_desc.num_reqs or num_reqs, self.spec
        return build_metadata(spec.attn_groups, n, spec.input_buffers.query_start_loc, spec.input_buffers.seq_lens)

    def _draft_step(self, num_tokens: int) -> None:
        """A draft step's forward ran (eager, or inside a replayed graph): the buffers it reads, and what the draft's attention
        metadata was last derived from."""
        spec = self.spec
        lanes = {name: getattr(spec.input_buffers, name).tolist() for name in LANE_BUFFERS}
        lanes["slot_mapping"] = spec.block_tables.slot_mappings[0].tolist()
        derived = self.attn_group.builder.derived
        self.steps.append({"step": int(spec.current_draft_step), "num_tokens": num_tokens, "lanes": lanes,
                           "metadata": None if derived is None else dict(derived)})

    def _prefill_outputs(self, _count: int) -> None:
        """What the draft model's prefill leaves for the decode steps (its graph or its eager call, both
        stand-ins here): each live request's position at its last accepted token, gathered by the last_token_indices
        the engine's prefill-input kernel computed, and its first draft token (whatever count the caller passes)."""
        if self.live is None:
            return  # capture() fires the hook too
        spec, num_reqs = self.spec, len(self.live["draft_tokens"])
        idx = spec.last_token_indices[:num_reqs]
        spec.input_buffers.positions[:num_reqs] = spec.input_buffers.positions[idx].clone()
        spec.draft_tokens[:num_reqs, 0] = torch.tensor(self.live["draft_tokens"])

    def _block_tables(self) -> Any:
        """BlockTables with the engine's compute_slot_mappings (its Triton kernel) over one KV group whose
        block table row r holds blocks 100 + r * width .. : the fields that method reads, set here."""
        bt = object.__new__(self.engine.attr("block_table", "BlockTables"))
        n, width = self.cfg.max_num_seqs, -(-self.cfg.max_model_len // KV_BLOCK_SIZE)
        self.kv_table = torch.arange(n * width, dtype=torch.int32).reshape(n, width) + 100
        bt.__dict__.update(
            num_kv_cache_groups=1, slot_mappings=torch.zeros(1, n * self.q, dtype=torch.int64),
            block_table_ptrs=torch.tensor([self.kv_table.data_ptr()], dtype=torch.uint64),
            block_table_strides=torch.tensor([width], dtype=torch.int64), block_sizes_tensor=torch.tensor([KV_BLOCK_SIZE], dtype=torch.int32),
            kernel_block_sizes_tensor=torch.tensor([KV_BLOCK_SIZE], dtype=torch.int32),  # up to 0.31: kernel blocks = KV blocks
            slot_mapping_enabled=torch.tensor([True]), dcp_sharded=torch.tensor([True]), cp_rank=0, cp_size=1, cp_interleave=1,
            # the batch's gathered block tables (a capture's dummy batch zeroes their rows; FULL replays map them to kernel blocks)
            input_block_tables=(torch.zeros_like(self.kv_table),), _num_dirty_rows=0)
        return bt

    def capture(self) -> RankCapture:
        out = RankCapture()
        pw = self.engine.capture.piecewise = []
        self.spec.capture()  # the draft decode manager is FULL-only: every PIECEWISE capture here is the prefill's
        out.piecewise["draft_prefill"], out.piecewise[self.decode_runner] = sorted(pw), []

        def create_forward_fn(desc: Any, warmup: bool) -> Any:
            across = torch.full((self.dp_size,), desc.num_tokens, dtype=torch.int32) if self.dp_size > 1 else None
            fwd = _recorder(self.engine)
            return lambda cg_mode: fwd(None, desc.num_reqs, desc.num_tokens, None, None, across, cg_mode)

        pw = self.engine.capture.piecewise = []
        self.target.capture(create_forward_fn)
        out.piecewise["target_verify"] = sorted(pw)
        self.engine.capture.piecewise = None
        for runner, mgr in self.managers().items():
            out.graphs[runner] = sorted(mgr.graphs.items(), key=lambda kv: kv[0].num_tokens)
        return out

    def managers(self) -> dict[str, Any]:
        return {"target_verify": self.target, "draft_prefill": self.spec.prefill_cudagraph_manager,
                self.decode_runner: self.spec.decode_cudagraph_manager}

    # ---- replay --------------------------------------------------------------------------------

    def target_dispatch(self, raw: int) -> tuple[Any, Any]:
        """The target's dispatch and DP agreement for a uniform decode of raw requests (collective)."""
        fn = self.engine.attr("dp", "dispatch_cg_and_sync_dp")
        # parallel_config (from 0.30) decides microbatching, which these batches never allow; max_query_len (from 0.28) selects
        # varlen decode graphs, which only adaptive verification captures
        extra = {"parallel_config": self.vcfg.parallel_config, "max_query_len": self.q}
        return fn(self.target, raw, raw * self.q, self.q, dp_size=self.dp_size, dp_rank=self.rank,
                  **{k: v for k, v in extra.items() if k in inspect.signature(fn).parameters})

    def proposer(self, it: int, dp_raw: list[int], tdesc: Any, tsync: Any) -> list[VllmReplay]:
        raw = dp_raw[self.rank]
        out = [self._record("target_verify", it, dp_raw, tdesc, tsync, self.target)]
        live, args = self._live_batch(it, raw, tdesc.num_tokens)
        self.live = live
        self.decode_calls.clear()
        self.steps = []
        log = self.engine.dispatched.log = []
        try:
            self.spec.propose(*args, **({} if self.sync_arg is None else {self.sync_arg: tsync}))
        finally:
            self.engine.dispatched.log, self.live = None, None
        prefill = [(d, sync) for mgr, d, sync in log if mgr is self.spec.prefill_cudagraph_manager]
        if len(prefill) != 1 or len(self.decode_calls) != 1:
            raise RuntimeError(f"propose() dispatched the draft prefill {len(prefill)} times and ran the decode steps "
                               f"{len(self.decode_calls)} times for one batch")
        out.append(self._record("draft_prefill", it, dp_raw, *prefill[0], self.spec.prefill_cudagraph_manager))
        num_reqs, ddesc, across = self.decode_calls[-1]
        rec = self._record(self.decode_runner, it, dp_raw, ddesc, across, self.spec.decode_cudagraph_manager, raw=num_reqs)
        rec.lanes, rec.live, rec.steps = (self.steps[0]["lanes"] if self.steps else None), live, self.steps
        out.append(rec)
        return out

    def _live_batch(self, it: int, raw: int, padded: int) -> tuple[dict[str, list[int]], tuple]:
        """The target's verify batch as propose() reads it: distinct per iteration and never a fill value.
        Request i holds q tokens ending at seq_len - 1 and had num_rejected of them rejected."""
        n, q = self.cfg.max_num_seqs, self.q
        seq_lens = [40 + 7 * it + 2 * i for i in range(raw)]
        rejected = [(i + it) % q for i in range(raw)]
        live = {"draft_tokens": [1000 + 97 * it + i for i in range(raw)], "target_seq_lens": seq_lens, "num_rejected": rejected,
                "positions": [s - 1 - j for s, j in zip(seq_lens, rejected, strict=True)], "idx_mapping": [(i + it) % n for i in range(raw)]}
        positions = [s - q + k for s in seq_lens for k in range(q)] + [0] * (padded - raw * q)
        i32 = torch.int32
        batch = Strict("input_batch", num_reqs=raw, num_tokens=raw * q, num_tokens_after_padding=padded,
                       num_scheduled_tokens=np.full(raw, q, dtype=np.int32), decode_graph_eligible=True, has_prefill=False,  # has_prefill up to 0.30
                       seq_lens=torch.tensor(seq_lens, dtype=i32), seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=i32),
                       idx_mapping=torch.tensor(live["idx_mapping"], dtype=i32), query_start_loc=torch.arange(raw + 1, dtype=i32) * q,
                       input_ids=torch.arange(padded, dtype=torch.int64) + 5000, positions=torch.tensor(positions, dtype=torch.int64))
        args = (batch, None, None, torch.zeros(padded, 1), None, torch.ones(raw, dtype=i32), torch.tensor(rejected, dtype=i32),
                torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=i32), torch.zeros(n), torch.zeros(n, dtype=torch.int64))
        return live, args

    def _record(self, runner: str, it: int, dp_raw: list[int], desc: Any, sync: Any, mgr: Any,
                raw: Optional[int] = None) -> VllmReplay:
        # the agreement: a list (noted by the decode run), a DPSyncState (from 0.29) or the bare tensor (up to 0.28)
        across = sync if isinstance(sync, list) or sync is None else getattr(sync, "num_tokens_across_dp", sync).tolist()
        graph = mgr.graphs.get(desc) if desc.cg_mode == self.mode.FULL else None
        baked = graph.baked if graph is not None else None
        q = desc.uniform_token_count or (self.q if runner not in DECODE_RUNNERS else 1)
        cap = CaptureRecord(bs=desc.num_reqs or 0, num_tokens=desc.num_tokens, host=dict(baked or {}, cg_mode=desc.cg_mode.name),
                            global_num_tokens_gpu=None if baked is None else baked["num_tokens_across_dp"], global_num_tokens_for_logprob_gpu=None)
        rec = ReplayRecord(runner=runner, step=0, branch="dp", raw_bs=dp_raw[self.rank] if raw is None else raw, bs=desc.num_reqs or 0,
                           tokens_per_bs=q, capture=cap, global_num_tokens_gpu=across, global_num_tokens_for_logprob_gpu=None,
                           gpu_shape=None if across is None else (len(across),), padded_seq_lens=[], seq_lens_sum=0, seq_lens_sum_actual=0,
                           captured_bs=sorted({d.num_reqs for d in mgr.graphs if d.uniform_token_count == q}))
        return VllmReplay(rec, desc.cg_mode.name, self.rank, it, list(dp_raw))


def decode_paths(engine: VllmEngine) -> tuple[bool, ...]:
    """The draft decode paths the release has (fused or not, as RankDriver takes them): the per-step loop always, the fused
    multi-step graph where the speculator has its run (from 0.28)."""
    eagle = engine.attr("eagle", "EagleSpeculator")
    return (False, True) if any(hasattr(eagle, n) for n in DECODE_RUNS[1]) else (False,)


def _recorder(engine: VllmEngine, on_run: Optional[Callable[[int], None]] = None, body: Optional[Callable[..., Any]] = None):
    """The draft model's forward (and the target's, for its capture): a graph capture pass's call is its bake (with the
    draft step of each forward the graph holds: all K - 1 in a fused graph); a PIECEWISE capture pass (no graph object) is
    noted by its token count; any other call (eager, or a replayed graph's body) is a run, passed to on_run. With a body
    (the engine's draft step), a run then runs it; a graph's capture pass only records it, as a GPU's does, and each
    replay re-runs it."""

    def forward(self, num_reqs, num_tokens, attn_metadata, slot_mappings, num_tokens_across_dp, cudagraph_runtime_mode, *a, **kw):
        g = engine.capture.current
        if g is not None:
            step = getattr(self, "current_draft_step", None)  # None: the target's forward
            steps = (g.baked or {}).get("draft_steps", []) + ([] if step is None else [int(step)])
            g.baked = {"num_reqs": num_reqs, "num_tokens": num_tokens, "draft_steps": steps,
                       "num_tokens_across_dp": None if num_tokens_across_dp is None else num_tokens_across_dp.tolist()}
            if a or "num_speculative_steps" in kw:  # a draft step count baked into the graph (from 0.32)
                g.baked["num_speculative_steps"] = kw.get("num_speculative_steps", a[0] if a else None)
        elif engine.capture.piecewise is not None and getattr(cudagraph_runtime_mode, "name", None) == "PIECEWISE":
            engine.capture.piecewise.append(num_tokens)
        elif on_run is not None:
            on_run(num_tokens)
        if body is not None and g is None:  # a capture pass records the body's kernels without running them
            body(self, num_reqs, num_tokens, attn_metadata, slot_mappings, num_tokens_across_dp, cudagraph_runtime_mode, *a, **kw)

    return forward


def drive_world(engine: VllmEngine, cfg: VllmCheckConfig, dp_size: int,
                fused: bool) -> tuple[list[RankCapture], list[VllmReplay], list[RankDriver]]:
    world = DPWorld(dp_size)
    engine.world = world
    ranks = [RankDriver(engine, cfg, dp_size, r, fused) for r in range(dp_size)]
    captures = [rk.capture() for rk in ranks]
    replays: list[VllmReplay] = []
    for it, dp_raw in enumerate(cfg.dp_schedule(dp_size)):
        agreed = world.run(lambda r, dp_raw=dp_raw: ranks[r].target_dispatch(dp_raw[r]))
        # every rank's propose() at once: a release whose draft decode agrees its own padding (up to 0.29) runs that
        # collective inside propose(), over the other ranks' real votes
        proposed = world.run(lambda r, it=it, dp_raw=dp_raw, agreed=agreed: ranks[r].proposer(it, dp_raw, *agreed[r]))
        replays += [rep for rank_replays in proposed for rep in rank_replays]
    engine.world = None
    return captures, replays, ranks
