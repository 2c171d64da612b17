"""The engine's eager draft-extend batch, from the scheduler's MLP sync to the first draft forward (I7: docs/engine-check.md).

Why: when the draft-extend graph cannot run, the multi-layer worker runs each draft layer
eagerly on a ForwardBatch it builds from the ScheduleBatch, and that batch's
global_num_tokens(_for_logprob) are not the graph runner's: they are the scheduler's
MLP-sync counts (requests, for a decode batch), all-gathered over every TP rank, scaled by
the worker's per-request widths (num_tokens_per_req, num_tokens_for_logprob_per_req). What
the eager logits processor then feeds lm_head depends on the worker's own choice to prune
logits to a row per request or not. Engine code driven here, per DP rank, all ranks at once:

  1. the scheduler's sync, `prepare_mlp_sync_batch_raw` (scheduler_dp_attn_mixin.py, later
     scheduler_components/dp_attn.py): each rank's count, its all-gather over the TP group
     (ranks are threads of harness.ranks.SimulatedWorld; the module's torch.distributed calls
     meet there), the idle batch an idle rank gets, `_update_gather_batch`;
  2. the worker, `MultiLayerEagleDraftWorker._draft_extend_for_decode`, up to its first eager
     draft forward: the spec input it builds, its prune decision, the batch it hands the layer.
     Its batch builder (prepare_for_draft_extend / prepare_for_extend_to_fill_draft_kvcache)
     is replaced: ForwardBatch.init_new needs a whole ScheduleBatch; the stand-in applies the
     engine's own count scaling (init_mlp_sync_metadata, spec_scale_global_num_tokens or
     get_spec_adjusted_global_num_tokens, whichever the release has) to the synced counts;
  3. the rows its logits processor hands lm_head (LogitsProcessor._get_pruned_states).
Not driven: ModelRunner.forward's eager DP padding (ForwardBatch.prepare_mlp_sync_batch), which
pads tokens to the DP maximum and leaves for_logprob as it is.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from harness.engines.lanes import live_batch
from harness.engines.sglang.build import EngineRunners
from harness.engines.sglang.errors import EngineAdapterError, MissingEngineAttribute, require
from harness.engines.sglang.logits_gather import _Baton
from harness.engines.sglang.standins import Strict, noop, patched
from harness.engines.sglang.stubs import LATE_STUBBED_MODULES, StubFinder
from harness.ranks.simulated import SimulatedWorld
from runners.parallel.comm import Group
from runners.parallel.layout import ParallelLayout

_WORKER = "sglang.srt.speculative.multi_layer_eagle_worker_v2"
_SYNC_MODULES = ("sglang.srt.managers.scheduler_components.dp_attn", "sglang.srt.managers.scheduler_dp_attn_mixin")


class _Reached(Exception):
    """The worker handed its first eager draft forward a batch: the drive stops there."""

    def __init__(self, fb: Any) -> None:
        super().__init__("first eager draft forward")
        self.fb = fb


@dataclass
class EagerBatch:
    """What one DP rank's eager draft-extend pass counts (None: the batch carries no DP counts)."""

    group: int
    raw_bs: int
    tokens_per_bs: int
    global_num_tokens: Optional[list[int]]
    global_num_tokens_for_logprob: Optional[list[int]]
    rows_fed: int  # rows the eager logits processor hands lm_head
    pruned: bool  # the worker set a select_index: lm_head sees one row per request
    forward_batch: Any = field(default=None, repr=False)  # what the worker handed its first eager draft forward


class ScheduleBatchStandIn(Strict):
    """The fields of a ScheduleBatch the sync and the worker read before the draft forward; sets are kept."""

    def __init__(self, fbi: Any, raw_bs: int, T: int, pool: int) -> None:
        idle = raw_bs == 0
        seq = torch.tensor([5 + 3 * i for i in range(raw_bs)], dtype=torch.int64)
        super().__init__("ScheduleBatch", forward_mode=fbi.ForwardMode.IDLE if idle else fbi.ForwardMode.DECODE, reqs=[],
                         seq_lens=seq, seq_lens_cpu=seq.clone(), spec_info=None, return_logprob=False, has_grammar=False,
                         global_num_tokens=None, global_num_tokens_for_logprob=None, draft_global_num_tokens=None,
                         draft_global_num_tokens_for_logprob=None, dp_spec_prefill_coordination_applied=False,
                         can_run_decode_cuda_graph=True, can_run_dp_draft_cuda_graph=True, is_extend_in_batch=False,
                         encoder_swa_reset=None, extend_lens=[], extend_num_tokens=0, multimodal_inputs=[None] * raw_bs,
                         req_pool_indices=torch.tensor([1 + i % (pool - 1) for i in range(raw_bs)], dtype=torch.int64))
        self.raw_bs = raw_bs

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def batch_size(self) -> int:
        return self.raw_bs


# ----------------------------------------------------------------------------------------
# 1. the scheduler's MLP sync, every TP rank at once
# ----------------------------------------------------------------------------------------


class _Rank(threading.local):
    rank: int = 0
    comm: Any = None
    baton: Optional[_Baton] = None


_RANK = _Rank()


def _gather(t: torch.Tensor) -> torch.Tensor:
    """Every rank's t, concatenated in rank order (the TP group is the layout's WORLD)."""
    with _RANK.baton.handed_on(_RANK.rank):
        return _RANK.comm.all_gather(t.contiguous().view(-1), Group.WORLD)


class _SimDistributed:
    """torch.distributed as the sync module calls it, over the simulated TP group; the rest is torch's own."""

    def __init__(self, world: int) -> None:
        self.world = world

    def get_world_size(self, group: Any = None) -> int:
        return self.world

    def get_rank(self, group: Any = None) -> int:
        return _RANK.rank

    def get_global_rank(self, group: Any, rank: int) -> int:
        return rank

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor, group: Any = None, **kw: Any) -> None:
        out.copy_(_gather(inp).view_as(out))

    def gather(self, inp: torch.Tensor, gather_list: Optional[list] = None, dst: int = 0, group: Any = None) -> None:
        rows = _gather(inp).view(self.world, -1)
        for dest, row in zip(gather_list or [], rows, strict=False):
            dest.copy_(row.view_as(dest))

    def broadcast(self, t: torch.Tensor, src: int = 0, group: Any = None) -> None:
        t.copy_(_gather(t).view(self.world, *t.shape)[src])

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)


class _TorchProxy:
    """The sync module's `torch`: torch, with distributed simulated."""

    def __init__(self, world: int) -> None:
        self.distributed = _SimDistributed(world)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _sync_module(engine: Any) -> Any:
    for name in _SYNC_MODULES:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise EngineAdapterError(f"sglang {engine.version}: no scheduler DP-attention module ({' / '.join(_SYNC_MODULES)})")


class _SyncGroup(Strict):
    """The scheduler's TP GroupCoordinator as the sync reads it: its process groups are the simulated world's."""

    def __init__(self, world: int) -> None:
        super().__init__("tp_group", cpu_group="sim-cpu", device_group="sim-device", device="cpu", world_size=world,
                         active_ranks_cpu=torch.ones(world, dtype=torch.int32), active_ranks=torch.ones(world, dtype=torch.int32))


def sync_counts(engine: Any, layout: ParallelLayout, server_args: Any, dp_sizes: list[int], T: int, pool: int,
                mlp_gather: bool) -> list[ScheduleBatchStandIn]:
    """Every TP rank's ScheduleBatch after the engine's MLP sync, one per DP group (the group's first TP rank's)."""
    mod, fbi = _sync_module(engine), engine.modules["fbi"]
    run = require(mod, "prepare_mlp_sync_batch_raw", engine.version, "the scheduler's MLP sync")
    group = _SyncGroup(layout.tp_size)
    lock = threading.Lock()
    baton = _Baton(lambda r: setattr(_RANK, "rank", r))
    args = dict(model_runner=Strict("model_runner", spec_algorithm=engine.modules["spec_info"].SpeculativeAlgorithm.from_string("EAGLE"),
                                    prefill_cuda_graph_runner=None, model_config=Strict("model_config")),
                dp_size=layout.attn_dp_size, attn_tp_size=layout.attn_tp_size, attn_cp_size=1, tp_group=group, disable_cuda_graph=False,
                require_mlp_tp_gather=mlp_gather, draft_require_mlp_tp_gather=mlp_gather, disable_overlap_schedule=False,
                offload_tags=set(), dwdp=False, sync_wait_carry=None)
    params = inspect.signature(run).parameters
    missing = [p for p in params if p not in args and p not in ("local_batch", "get_idle_batch")]
    if missing:
        raise MissingEngineAttribute(f"prepare_mlp_sync_batch_raw takes {missing}, which the adapter does not provide")
    kwargs = {k: v for k, v in args.items() if k in params}
    batches: dict[int, ScheduleBatchStandIn] = {}

    def rank_main(comm: Any) -> None:
        r = comm.rank
        _RANK.comm, _RANK.baton = comm, baton
        d = layout.attn_dp_rank(r)
        try:
            with baton.held(r):
                local = ScheduleBatchStandIn(fbi, dp_sizes[d], T, pool) if dp_sizes[d] else None
                out = run(local, get_idle_batch=lambda: ScheduleBatchStandIn(fbi, 0, T, pool), **kwargs)
                if r == d * layout.attn_tp_size:
                    with lock:
                        batches[d] = out
        finally:
            _RANK.comm = _RANK.baton = None

    with patched(mod, "torch", _TorchProxy(layout.tp_size), engine.version, "the sync's collectives"), _sync_helpers(mod, engine, group):
        SimulatedWorld(layout, timeout_s=60.0).run(rank_main)
    return [batches[d] for d in range(layout.attn_dp_size)]


class _ParallelView:
    """get_parallel() as the sync reads it: the published context, with the TP group the simulated one."""

    def __init__(self, real: Callable[[], Any], group: _SyncGroup) -> None:
        self._real, self.tp_group = real, group

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real(), name)


@contextlib.contextmanager
def _sync_helpers(mod: Any, engine: Any, group: _SyncGroup) -> Iterator[None]:
    """The module-level collective helper (all_gather_single) and parallel context of releases that have them, simulated."""
    with contextlib.ExitStack() as stack:
        if hasattr(mod, "all_gather_single"):
            stack.enter_context(patched(mod, "all_gather_single", lambda out, inp, group=None, **k: out.copy_(_gather(inp).view_as(out)),
                                        engine.version, "the sync's all-gather"))
        if hasattr(mod, "get_parallel"):
            view = _ParallelView(mod.get_parallel, group)
            stack.enter_context(patched(mod, "get_parallel", lambda: view, engine.version, "the sync's parallel context"))
        if hasattr(mod, "get_tp_group"):
            stack.enter_context(patched(mod, "get_tp_group", lambda: group, engine.version, "the sync's TP group"))
        yield


# ----------------------------------------------------------------------------------------
# 2. the worker, up to its first eager draft forward
# ----------------------------------------------------------------------------------------


def _scaled_counts(engine: Any, fb: Any, batch: Any, spec: Any) -> None:
    """The forward batch's DP counts from the synced ScheduleBatch, by the release's own scaling (init_new's MLP-sync part)."""
    fbi, si = engine.modules["fbi"], engine.modules["spec_info"]
    for name in ("global_num_tokens_cpu", "global_num_tokens_for_logprob_cpu", "global_num_tokens_gpu", "global_num_tokens_for_logprob_gpu",
                 "original_global_num_tokens_cpu"):
        setattr(fb, name, None)
    init = getattr(fbi.ForwardBatch, "init_mlp_sync_metadata", None)
    if init is not None:
        kw = {"is_draft_worker": True} if "is_draft_worker" in inspect.signature(init).parameters else {}
        init(fb, batch, "cpu", **kw)
        return
    if batch.global_num_tokens is None:
        return
    if hasattr(si, "spec_scale_global_num_tokens"):
        g, lp = si.spec_scale_global_num_tokens(spec, batch.global_num_tokens, batch.global_num_tokens_for_logprob)
    else:
        g, lp = spec.get_spec_adjusted_global_num_tokens(batch)
    fb.original_global_num_tokens_cpu, fb.global_num_tokens_cpu, fb.global_num_tokens_for_logprob_cpu = batch.global_num_tokens, g, lp
    fb.global_num_tokens_gpu = torch.tensor(g, dtype=torch.int64)
    fb.global_num_tokens_for_logprob_gpu = torch.tensor(lp, dtype=torch.int64)


def eager_batch(engine: Any, runners: EngineRunners, batch: ScheduleBatchStandIn, group: int, dp_sizes: list[int]) -> EagerBatch:
    """Drive the worker's _draft_extend_for_decode on the synced batch until its first eager draft forward."""
    wmod = _import_worker(engine)
    Worker = require(wmod, "MultiLayerEagleDraftWorker", engine.version, "the multi-layer EAGLE draft worker")
    cfg, comp, fbi = runners.cfg, runners.composite, engine.modules["fbi"]
    T = runners.multi[0].tokens_per_bs
    raw = batch.raw_bs
    live = live_batch(raw, dp_sizes, 0, T, cfg.max_running_requests)

    def build(spec: Any, sbatch: Any, *args: Any, **kwargs: Any) -> Any:
        sbatch.spec_info = spec
        fb = runners._forward_batch(live, T)
        fb.spec_info = spec
        fb.forward_mode = fbi.ForwardMode.IDLE if sbatch.forward_mode.is_idle() else fbi.ForwardMode.DRAFT_EXTEND_V2
        _scaled_counts(engine, fb, sbatch, spec)
        return fb

    def forward(fb: Any, *args: Any, **kwargs: Any) -> Any:
        raise _Reached(fb)

    graph = {"can_run_graph": lambda fb: False, "can_run": lambda fb: False}
    if hasattr(comp, "prune_draft_extend_logits"):
        graph["prune_draft_extend_logits"] = comp.prune_draft_extend_logits  # the engine's own decision, for this layout
    cgr = Strict("cuda_graph_runner_for_draft_extend", **graph)
    mr = runners.multi[0].runner.model_runner if hasattr(runners.multi[0].runner, "model_runner") else None
    draft_runners = [Strict("draft_runner", forward=forward, req_to_token_pool=None, token_to_kv_pool=None,
                            attn_backend=Strict("attn_backend", init_forward_metadata=noop),
                            model_config=getattr(mr, "model_config", None), spec_algorithm=getattr(mr, "spec_algorithm", None))
                     for _ in range(cfg.num_steps)]
    worker = Strict("eagle_worker", speculative_num_steps=cfg.num_steps, speculative_num_draft_tokens=cfg.num_draft_tokens, topk=cfg.topk,
                    draft_extend_num_front_tokens=0, cuda_graph_runner_for_draft_extend=cgr, prepare_for_draft_extend=build, plan_stream=None,
                    plan_stream_ctx=contextlib.nullcontext(), draft_runner_list=draft_runners, device="cpu", server_args=runners.server_args,
                    use_rejection_sampling=False,
                    _apply_deferred_mamba_init_to_draft_pools=noop, _fill_boundary_kv_front_and_update_stash=noop)
    if hasattr(Worker, "_compute_boundary_kv_locs_positions"):  # the engine's own: no widened window (0 front tokens), its Nones
        object.__setattr__(worker, "_compute_boundary_kv_locs_positions", lambda b: Worker._compute_boundary_kv_locs_positions(worker, b))
    accept = torch.tensor(live.accept_lens, dtype=torch.int32)
    result = Strict("batch_result", next_token_ids=torch.tensor(live.tokens(T)["input_ids"], dtype=torch.int64), accept_lens=accept,
                    logits_output=Strict("logits_output", hidden_states=torch.zeros(raw * T, cfg.hidden_size)))
    quiet = Strict("logger", warning_once=noop, warning=noop, info=noop, debug=noop)  # warning_once is SGLang's patch of logging
    with _builder_patched(engine, wmod, build), patched(wmod, "logger", quiet, engine.version, "the worker's logger"):
        try:
            Worker._draft_extend_for_decode(worker, batch, result)
        except _Reached as r:
            fb = r.fb
        else:
            raise EngineAdapterError(f"sglang {engine.version}: _draft_extend_for_decode returned without an eager draft forward")
    pruned = getattr(fb.spec_info, "select_index", None) is not None
    rows = 0 if raw == 0 else int(runners.multi[0].pruned_states(fb, torch.zeros(raw * T, cfg.hidden_size)).shape[0])
    lp = fb.global_num_tokens_for_logprob_cpu
    return EagerBatch(group, raw, T, None if fb.global_num_tokens_cpu is None else list(fb.global_num_tokens_cpu),
                      None if lp is None else list(lp), rows, pruned, fb)


def _import_worker(engine: Any) -> Any:
    """The worker module; an import it needs that LATE_STUBBED_MODULES lists (0.5.11 - 0.5.13.post1 import sgl_kernel
    unconditionally on the way) is stubbed, as the loader does for the runner modules, and named in the report."""
    finder = next(f for f in sys.meta_path if isinstance(f, StubFinder))
    while True:
        try:
            return importlib.import_module(_WORKER)
        except ModuleNotFoundError as e:
            top = (e.name or "").split(".")[0]
            if top not in LATE_STUBBED_MODULES or top in finder.names:
                raise
            finder.names = finder.names | {top}
            engine.stubbed = sorted({*engine.stubbed, top})


@contextlib.contextmanager
def _builder_patched(engine: Any, wmod: Any, build: Callable[..., Any]) -> Iterator[None]:
    """The worker's batch builder, replaced where it lives: a module function (0.5.16 on), the draft input's method
    (up to 0.5.13.post1); 0.5.14 - 0.5.15.post1 call the worker's own method, which the stand-in worker carries."""
    if hasattr(wmod, "prepare_for_draft_extend"):
        with patched(wmod, "prepare_for_draft_extend", build, engine.version, "the eager draft-extend batch builder"):
            yield
        return
    cls = getattr(wmod, "EagleDraftInput", None)
    if cls is None or not hasattr(cls, "prepare_for_extend_to_fill_draft_kvcache"):
        yield
        return
    with patched(cls, "prepare_for_extend_to_fill_draft_kvcache", lambda self, *a, **k: build(self, *a, **k), engine.version,
                 "the eager draft-extend batch builder"):
        yield


def require_mlp_sync(engine: Any, server_args: Any) -> bool:
    """The engine's own rule for whether the scheduler syncs a batch over DP ranks (DP attention or a gathered buffer)."""
    mod = importlib.import_module("sglang.srt.utils.common")
    fn = require(mod, "require_mlp_sync", engine.version, "whether the scheduler runs the MLP sync")
    return bool(fn(server_args) if inspect.signature(fn).parameters else fn())


def unsynced(engine: Any, raw_bs: int, T: int, pool: int) -> ScheduleBatchStandIn:
    """A DP rank's batch where the scheduler runs no MLP sync: no DP counts."""
    return ScheduleBatchStandIn(engine.modules["fbi"], raw_bs, T, pool)
