"""Drive vLLM's EAGLE proposer CUDA-graph path for one DP world, without a model or a GPU.

Per DP rank: an EagleSpeculator whose graph managers come from its own
init_cudagraph_manager and are captured by its own capture() (the forward it captures, the
draft model, is a recorder: what a capture pass bakes is the graph's bake), and the target's
uniform-decode graph manager, whose DP agreement the proposer reuses. Per iteration of the
schedule, every rank at once (one thread each) runs the engine's dispatch_cg_and_sync_dp for
the target (the collective that pads every rank to one count); then each rank runs the
draft prefill dispatch on that agreement and replays its graph, and the proposer's own
_run_multi_step_decode: the decode dispatch, _prepare_decode_inputs (its Triton kernel) and
the K - 1 draft decode replays. Everything is converted into ReplayRecord / CaptureRecord.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from harness.engines.vllm.config import VllmCheckConfig
from harness.engines.vllm.loader import VllmEngine
from harness.engines.vllm.standins import DPWorld, FakeGraph, Strict, config_standin
from harness.records import CaptureRecord, ReplayRecord

RUNNERS = ("target_verify", "draft_prefill", "draft_decode")
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
    lanes: Optional[dict[str, list[int]]] = None  # the decode input buffers after _prepare_decode_inputs
    live: Optional[dict[str, list[int]]] = None  # what this rank's real lanes were given


@dataclass
class RankCapture:
    """One rank's captured graphs per runner: (descriptor, graph with its bake), by token count."""

    graphs: dict[str, list[tuple[Any, FakeGraph]]] = field(default_factory=dict)


def vllm_config(engine: VllmEngine, cfg: VllmCheckConfig, dp_size: int, dp_rank: int) -> Strict:
    comp = engine.modules["compilation"]
    spec = Strict("speculative_config", method="eagle", num_speculative_tokens=cfg.num_speculative_tokens,
                  num_speculative_tokens_per_batch_size=None,
                  uses_dynamic_speculative_decoding=lambda: False, use_multi_module_mtp=lambda: False, use_gemma4_mtp=lambda: False)
    compilation = Strict("compilation_config", cudagraph_mode=comp.CUDAGraphMode.FULL_AND_PIECEWISE,
                         prefill_cudagraph_capture_token_sizes=[], decode_cudagraph_capture_request_sizes=list(cfg.decode_request_sizes),
                         max_cudagraph_capture_size=cfg.max_cudagraph_capture_size, max_decode_cudagraph_capture_tokens=None,
                         max_decode_cudagraph_capture_requests=None, use_breakable_cudagraph=False)
    return config_standin(
        engine.attr("config", "VllmConfig"),
        num_speculative_tokens=cfg.num_speculative_tokens, speculative_config=spec, compilation_config=compilation,
        scheduler_config=Strict("scheduler_config", max_num_seqs=cfg.max_num_seqs,
                                max_num_batched_tokens=cfg.max_num_seqs * (1 + cfg.num_speculative_tokens)),
        parallel_config=Strict("parallel_config", tensor_parallel_size=1, data_parallel_size=dp_size, data_parallel_rank=dp_rank,
                               enable_fault_tolerance=False),
        cache_config=Strict("cache_config", use_kda_recoverssm=False),
        model_config=Strict("model_config", max_model_len=cfg.max_model_len),
    )


class RankDriver:
    """One DP rank: its EagleSpeculator (engine methods, stand-in state) and the target's manager."""

    def __init__(self, engine: VllmEngine, cfg: VllmCheckConfig, dp_size: int, rank: int) -> None:
        self.engine, self.cfg, self.dp_size, self.rank = engine, cfg, dp_size, rank
        self.vcfg = vllm_config(engine, cfg, dp_size, rank)
        self.mode = engine.modules["compilation"].CUDAGraphMode
        self.K = cfg.num_speculative_tokens
        self.q = 1 + self.K
        self.spec = self._speculator()
        self.spec.init_cudagraph_manager(self.mode.FULL_AND_PIECEWISE)
        cgm = engine.attr("cg", "CudaGraphManager")
        self.target = cgm(self.vcfg, torch.device("cpu"), self.mode.FULL_AND_PIECEWISE,
                          decode_query_lens=self.vcfg.get_decode_cudagraph_query_lens(self.vcfg.uniform_decode_query_len))
        self.decode_calls: list[tuple] = []

    def _speculator(self) -> Any:
        eagle = self.engine.attr("eagle", "EagleSpeculator")
        ib = self.engine.attr("input_batch", "InputBuffers")
        n, max_tokens = self.cfg.max_num_seqs, self.cfg.max_num_seqs * self.q
        cls = type("EngineCheckEagleSpeculator", (eagle,), {"_prefill": _recorder(self.engine), "_decode": _recorder(self.engine),
                                                            "_build_uniform_attn_metadata": lambda *a, **k: None})
        s = object.__new__(cls)  # the engine's __init__ builds the draft model's state; the fields the paths read are set here
        s.__dict__.update(
            vllm_config=self.vcfg, device=torch.device("cpu"), speculative_config=self.vcfg.speculative_config,
            num_speculative_steps=self.K, max_num_reqs=n, max_num_tokens=max_tokens,
            dp_size=self.dp_size, dp_rank=self.rank, enable_adaptive_verification=False, supports_decode_metadata_update=False,
            input_buffers=ib(n, max_tokens, torch.device("cpu")), target_input_buffers=ib(n, max_tokens, torch.device("cpu")),
            can_reuse_target_attn_metadata=True, target_attn_groups=[], attn_groups=[], model_state=None, block_tables=self._block_tables(),
            kv_cache_config=None, model=None,
            last_token_indices=torch.zeros(n, dtype=torch.int64), current_draft_step=torch.tensor(0, dtype=torch.int64),
            idx_mapping=torch.zeros(n, dtype=torch.int32), draft_tokens=torch.zeros(n, self.K, dtype=torch.int64),
            sample_src_positions=torch.zeros(n, dtype=torch.int64),
        )
        inner = s._multi_step_decode

        def multi_step_decode(num_reqs, skip_attn, batch_desc, num_tokens_across_dp, *rest):
            self.decode_calls.append((num_reqs, batch_desc, None if num_tokens_across_dp is None else num_tokens_across_dp.tolist()))
            return inner(num_reqs, skip_attn, batch_desc, num_tokens_across_dp, *rest)

        s._multi_step_decode = multi_step_decode
        return s

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
            slot_mapping_enabled=torch.tensor([True]), dcp_sharded=torch.tensor([True]), cp_rank=0, cp_size=1, cp_interleave=1)
        return bt

    def capture(self) -> RankCapture:
        self.spec.capture()

        def create_forward_fn(desc: Any, warmup: bool) -> Any:
            across = torch.full((self.dp_size,), desc.num_tokens, dtype=torch.int32) if self.dp_size > 1 else None
            fwd = _recorder(self.engine)
            return lambda cg_mode: fwd(None, desc.num_reqs, desc.num_tokens, None, None, across, cg_mode)

        self.target.capture(create_forward_fn)
        out = RankCapture()
        for runner, mgr in self.managers().items():
            out.graphs[runner] = sorted(mgr.graphs.items(), key=lambda kv: kv[0].num_tokens)
        return out

    def managers(self) -> dict[str, Any]:
        return {"target_verify": self.target, "draft_prefill": self.spec.prefill_cudagraph_manager,
                "draft_decode": self.spec.decode_cudagraph_manager}

    # ---- replay --------------------------------------------------------------------------------

    def target_dispatch(self, raw: int) -> tuple[Any, Any]:
        """The target's dispatch and DP agreement for a uniform decode of raw requests (collective)."""
        fn = self.engine.attr("dp", "dispatch_cg_and_sync_dp")
        return fn(self.target, raw, raw * self.q, self.q, dp_size=self.dp_size, dp_rank=self.rank, max_query_len=self.q,
                  parallel_config=self.vcfg.parallel_config)

    def proposer(self, it: int, dp_raw: list[int], tdesc: Any, tsync: Any) -> list[VllmReplay]:
        raw = dp_raw[self.rank]
        out = [self._record("target_verify", it, dp_raw, tdesc, tsync, self.target, replay=False)]
        fn = self.engine.attr("dp", "dispatch_cg_and_sync_dp")
        pdesc, psync = fn(self.spec.prefill_cudagraph_manager, raw, tdesc.num_tokens, self.q, dp_size=self.dp_size,
                          dp_rank=self.rank, max_query_len=self.q, dp_sync_state=tsync, parallel_config=self.vcfg.parallel_config)
        out.append(self._record("draft_prefill", it, dp_raw, pdesc, psync, self.spec.prefill_cudagraph_manager, replay=True))
        live = self._live_decode_inputs(it, raw)
        self.decode_calls.clear()
        batch = Strict("input_batch", seq_lens=torch.tensor(live["target_seq_lens"], dtype=torch.int32))
        self.spec._run_multi_step_decode(batch, torch.tensor(live["num_rejected"], dtype=torch.int32), raw, False, tsync,
                                         torch.tensor(live["target_seq_lens"]), False, self.K)
        num_reqs, ddesc, across = self.decode_calls[-1]
        lanes = {name: getattr(self.spec.input_buffers, name).tolist() for name in LANE_BUFFERS}
        lanes["slot_mapping"] = self.spec.block_tables.slot_mappings[0].tolist()
        rec = self._record("draft_decode", it, dp_raw, ddesc, across, self.spec.decode_cudagraph_manager, replay=False, raw=num_reqs)
        rec.lanes, rec.live = lanes, live
        out.append(rec)
        return out

    def _live_decode_inputs(self, it: int, raw: int) -> dict[str, list[int]]:
        """Distinct per iteration and never a fill value; written where the target's step leaves them."""
        n = self.cfg.max_num_seqs
        live = {"draft_tokens": [1000 + 97 * it + i for i in range(raw)], "positions": [30 + 5 * it + i for i in range(raw)],
                "target_seq_lens": [40 + 7 * it + 2 * i for i in range(raw)], "num_rejected": [(i + it) % self.q for i in range(raw)],
                "idx_mapping": [(i + it) % n for i in range(raw)]}
        self.spec.draft_tokens[:raw, 0] = torch.tensor(live["draft_tokens"])
        # as _copy_request_inputs leaves it: the live requests' rows, -1 (no blocks) past them
        self.spec.idx_mapping[:raw] = torch.tensor(live["idx_mapping"])
        self.spec.idx_mapping[raw:] = -1
        self.spec.input_buffers.positions[:raw] = torch.tensor(live["positions"])
        return live

    def _record(self, runner: str, it: int, dp_raw: list[int], desc: Any, sync: Any, mgr: Any, *, replay: bool,
                raw: Optional[int] = None) -> VllmReplay:
        across = sync if isinstance(sync, list) or sync is None else sync.num_tokens_across_dp.tolist()
        graph = mgr.graphs.get(desc) if desc.cg_mode == self.mode.FULL else None
        if graph is not None and replay:
            mgr.run_fullgraph(desc)
        baked = graph.baked if graph is not None else None
        q = desc.uniform_token_count or (self.q if runner != "draft_decode" else 1)
        cap = CaptureRecord(bs=desc.num_reqs or 0, num_tokens=desc.num_tokens, host=dict(baked or {}, cg_mode=desc.cg_mode.name),
                            global_num_tokens_gpu=None if baked is None else baked["num_tokens_across_dp"], global_num_tokens_for_logprob_gpu=None)
        rec = ReplayRecord(runner=runner, step=0, branch="dp", raw_bs=dp_raw[self.rank] if raw is None else raw, bs=desc.num_reqs or 0,
                           tokens_per_bs=q, capture=cap, global_num_tokens_gpu=across, global_num_tokens_for_logprob_gpu=None,
                           gpu_shape=None if across is None else (len(across),), padded_seq_lens=[], seq_lens_sum=0, seq_lens_sum_actual=0,
                           captured_bs=sorted({d.num_reqs for d in mgr.graphs if d.uniform_token_count == q}))
        return VllmReplay(rec, desc.cg_mode.name, self.rank, it, list(dp_raw))


def _recorder(engine: VllmEngine):
    """The draft model's forward (and the target's, for its capture): a graph capture pass's call is its bake."""

    def forward(self, num_reqs, num_tokens, attn_metadata, slot_mappings, num_tokens_across_dp, cudagraph_runtime_mode, *a, **kw):
        g = engine.capture.current
        if g is not None:
            g.baked = {"num_reqs": num_reqs, "num_tokens": num_tokens,
                       "num_tokens_across_dp": None if num_tokens_across_dp is None else num_tokens_across_dp.tolist(),
                       "num_speculative_steps": kw.get("num_speculative_steps", a[0] if a else None)}

    return forward


def schedule(cfg: VllmCheckConfig, dp_size: int) -> list[list[int]]:
    """Growing then shrinking: each (per-rank sizes) tuple runs once after smaller batches and once after larger ones."""
    up = [[max(1, s - 3 * r) for r in range(dp_size)] for s in cfg.schedule]
    return up + up[::-1][1:]


def drive_world(engine: VllmEngine, cfg: VllmCheckConfig, dp_size: int) -> tuple[list[RankCapture], list[VllmReplay], list[RankDriver]]:
    world = DPWorld(dp_size)
    engine.world = world
    ranks = [RankDriver(engine, cfg, dp_size, r) for r in range(dp_size)]
    captures = [rk.capture() for rk in ranks]
    replays: list[VllmReplay] = []
    for it, dp_raw in enumerate(schedule(cfg, dp_size)):
        agreed = world.run(lambda r, dp_raw=dp_raw: ranks[r].target_dispatch(dp_raw[r]))
        for r, (tdesc, tsync) in enumerate(agreed):
            replays += ranks[r].proposer(it, dp_raw, tdesc, tsync)
    engine.world = None
    return captures, replays, ranks
