"""Drive vllm-ascend's EAGLE proposer through capture and replay of its merged draft graph, one DP world at a time.

Per DP rank (one thread each, the vLLM adapter's DPWorld): an AscendEagleProposer built by its
own __init__ and load_model over stand-ins (standins.py), its attention groups by
initialize_attn_backend, its cudagraph keys from the runner's dispatcher. Capture is the
model runner's loop (vLLM's capture_model / _warmup_and_capture, vllm-ascend's _dummy_run,
model_runner_v1.py:3367-3663): per FULL key, largest first, a warm-up and a capture pass,
each setting the runner's buffers as _dummy_run does and calling the proposer's dummy_run.
Then per iteration of the schedule every rank at once runs one speculative step's draft: the
runner's buffers for a decode batch of 1 + K tokens per request, its metadata
(_build_attention_metadata's cm_base, unpadded: model_runner_v1.py:3161-3191, 3343-3349), the
proposer's prepare_inputs_padded and _propose, which dispatches, agrees across DP ranks,
builds every draft step's metadata, replays the graph and rewrites its attention tasks.
What each replay saw is returned as AscendReplay records; nothing is judged here (checks.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from harness.engines.sglang.errors import EngineAdapterError
from harness.engines.vllm.standins import DPWorld
from harness.engines.vllm_ascend.config import AscendCheckConfig, World
from harness.engines.vllm_ascend.loader import AscendEngine
from harness.engines.vllm_ascend.npu import AclGraph
from harness.engines.vllm_ascend.runner import ModelRunner
from harness.engines.vllm_ascend.standins import (
    DRAFT_LAYER,
    NUM_KV_BLOCKS,
    TARGET_LAYER,
    DraftModel,
    draft_attention,
    kv_cache_spec,
    target_model,
    vllm_config,
)


@dataclass
class Capture:
    """One captured graph on one rank: its key and what its capture pass baked."""

    num_tokens: int
    num_reqs: Optional[int]
    uniform: bool
    graph: AclGraph
    baked: dict[str, Any]  # the body's num_input_tokens, batch_size, sample_rows; its forward context's (context_record)


@dataclass
class AscendReplay:
    """One rank's draft for one iteration: the live batch, the dispatch, and what the replayed graph ran with."""

    rank: int
    iteration: int
    dp_raw: list[int]
    raw: int
    live: dict[str, list[int]]  # per real request: seq_lens (after verify), sampled rows and positions, rejected, next ids
    mode: str  # FULL / NONE (eager: no graph)
    num_input_tokens: int
    num_tokens_across_dp: Optional[list[int]]
    desc: tuple[int, Optional[int], bool]  # the batch descriptor replayed: (num_tokens, num_reqs, uniform)
    capture: Optional[Capture]
    replays: int  # how often that graph replayed during this step
    tasks: list[dict[str, Any]] = field(default_factory=list)  # per captured task: captured rows, the updates of this replay
    slot_rows: list[list[int]] = field(default_factory=list)  # per draft step: the slot mapping rows its captured KV write reads
    kv_writes: list[list[int]] = field(default_factory=list)  # per KV write launched during the replay: its slots
    steps: list[dict[str, list[int]]] = field(default_factory=list)  # per draft forward: the ids and positions it read
    draft: list[list[int]] = field(default_factory=list)  # the proposed drafts of the real requests
    sample_rows: list[int] = field(default_factory=list)  # token_indices_to_sample as the graph reads it (its captured rows)


class RankDriver:
    """One DP rank: its proposer over a model-runner stand-in."""

    def __init__(self, engine: AscendEngine, cfg: AscendCheckConfig, world: World, rank: int) -> None:
        self.engine, self.cfg, self.world, self.rank = engine, cfg, world, rank
        self.vcfg = vllm_config(engine, cfg, world, rank)
        self.cg = engine.modules["compilation"].CUDAGraphMode
        self.runner = ModelRunner(engine, cfg, world, rank, self.vcfg)
        self.proposer = self._proposer()
        self.captures: dict[tuple, Capture] = {}

    # --- the proposer, built and loaded by its own code ----------------------------------------------------------
    def _proposer(self) -> Any:
        eng, vcfg = self.engine, self.vcfg
        ascend_config = eng.attr("ascend_config", "init_ascend_config")(vcfg)
        object.__setattr__(self.runner.state, "ascend_config", ascend_config)
        static = vcfg.compilation_config.static_forward_context
        static.clear()
        static[TARGET_LAYER] = draft_attention(eng, TARGET_LAYER)  # the target's layer (load_model tells drafts from it)
        attention = draft_attention(eng, DRAFT_LAYER)
        self.model = DraftModel(attention)
        cls = type("EngineCheckEagleProposer", (eng.attr("eagle", "AscendEagleProposer"),),
                   {"_get_model": lambda proposer: self._register_draft(attention)})
        p = cls(vcfg, torch.device("cpu"), runner=self.runner.state)
        target = target_model()
        object.__setattr__(self.runner.state, "get_model", lambda: target)
        p.load_model(target)
        p.initialize_attn_backend(self._kv_cache_config())
        self.runner.settle_cudagraph_mode(p)
        wrapper_cls = eng.attr("acl_graph", "ACLGraphWrapper")
        if not isinstance(p._runnable, wrapper_cls):
            raise EngineAdapterError(f"vllm-ascend {eng.version}: load_model left the merged draft unwrapped ({p._runnable!r}) under "
                                     f"cudagraph_mode={self.world.mode.value}: no draft graph to check")
        p._runnable.runnable = self._graph_body(p._runnable.runnable)
        self.observer = Observed(eng, p._runnable)
        p._runnable = self.observer
        return p

    def _register_draft(self, attention: Any) -> DraftModel:
        """The draft model load_model gets: its attention layer joins the static forward context, as vLLM's Attention does."""
        self.vcfg.compilation_config.static_forward_context[DRAFT_LAYER] = attention
        return self.model

    def _kv_cache_config(self) -> Any:
        kv = self.engine.modules["kv_cache_interface"]
        group = kv.KVCacheGroupSpec(layer_names=[TARGET_LAYER, DRAFT_LAYER], kv_cache_spec=kv_cache_spec(self.engine))
        return kv.KVCacheConfig(num_blocks=NUM_KV_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[group])

    def _graph_body(self, runnable: Any) -> Any:
        """ACLGraphWrapper's runnable: its call inside a capture becomes that graph's body (re-run at replay)."""
        runtime = self.engine.runtime

        def run(*args: Any, **kwargs: Any) -> Any:
            g = runtime.capturing
            out = runnable(*args, **kwargs)
            if g is not None and g.body is None:
                g.body = lambda: runnable(*args, **kwargs)
                g.output = out
                g.baked = {"num_input_tokens": kwargs["num_input_tokens"], "batch_size": kwargs["batch_size"],
                           "sample_rows": int(kwargs["token_indices_to_sample"].shape[0])}
            return out

        return run

    # --- capture: the runner's capture loop -------------------------------------------------------------------
    def capture(self) -> None:
        """Per FULL key, largest first: the warm-up pass (eager) and the capture pass, as the runner runs them."""
        for mode, descs in self.runner.state.cudagraph_dispatcher.get_capture_descs():
            if mode != self.cg.FULL:
                raise EngineAdapterError(f"the dispatcher asks for {mode.name} captures; the adapter drives FULL ones")
            for desc in descs:
                for _ in range(self.vcfg.compilation_config.cudagraph_num_of_warmups):
                    self.runner.dummy_run(self.proposer, desc, self.cg.NONE)
                self.runner.dummy_run(self.proposer, desc, self.cg.FULL)
                wrapper = self.proposer._runnable
                entry = wrapper.concrete_aclgraph_entries.get(desc)
                if entry is None or entry.aclgraph is None:
                    raise EngineAdapterError(f"capturing {desc} left no ACL graph in the proposer's wrapper")
                g = entry.aclgraph
                if g.context is None:
                    raise EngineAdapterError(f"the capture of {desc} ran outside a forward context")
                baked = {**g.baked, **context_record(g.context)}
                self.captures[_key(desc)] = Capture(desc.num_tokens, desc.num_reqs, desc.uniform, g, baked)

    # --- one speculative step's draft ----------------------------------------------------------------------------
    def step(self, t: int, dp_raw: list[int]) -> AscendReplay:
        raw = dp_raw[self.rank]
        batch = self.runner.decode_batch(t, raw)
        p, r = self.proposer, self.runner.state
        cm, token_indices, sample_idx, rejected = p.prepare_inputs_padded(batch.common_attn_metadata, batch.spec_decode_metadata,
                                                                           batch.valid_sampled_tokens_count)
        runtime = self.engine.runtime
        self.model.calls.clear()
        runtime.kv_writes.clear()
        self.observer.calls.clear()
        seen = {k: (c.graph.replays, [len(task.updates) for task in c.graph.tasks]) for k, c in self.captures.items()}
        ids = r.input_ids.gpu[token_indices]  # propose_draft_token_ids (model_runner_v1.py:1890-1913)
        out = p._propose(target_token_ids=ids, target_positions=r.positions[token_indices],
                         target_hidden_states=ids.to(torch.float32).view(-1, 1), next_token_ids=batch.next_token_ids,
                         token_indices_to_sample=sample_idx, common_attn_metadata=cm, target_model_batch_desc=batch.target_desc,
                         sampling_metadata=None, num_rejected_tokens_gpu=rejected)
        if len(self.observer.calls) != 1:
            raise EngineAdapterError(f"_propose ran the draft {len(self.observer.calls)} times in one step")
        ctx = self.observer.calls[0]
        desc = ctx["desc"]
        cap = self.captures.get(desc) if ctx["mode"] == "FULL" else None
        live = {"seq_lens": batch.seq_lens, "sampled_positions": r.positions[sample_idx].tolist(), "rejected": rejected.tolist(),
                "next_ids": batch.next_token_ids.tolist(), "sample_idx": sample_idx.tolist()}
        rep = AscendReplay(self.rank, t, list(dp_raw), raw, live, ctx["mode"], ctx["num_tokens"], ctx["dp_tokens"], desc, cap,
                           0 if cap is None else cap.graph.replays - seen[desc][0])
        if cap is not None:
            before = seen[desc][1]
            rep.tasks = [{"rows": task.query_rows, "captured": task.captured, "updates": [u for _, u in task.updates[before[i]:]]}
                         for i, task in enumerate(cap.graph.tasks)]
            rep.slot_rows = [grp[: cap.baked["num_input_tokens"]].tolist() for grp in p.slot_mapping_group]
            rep.sample_rows = p.token_indices_to_sample[: cap.baked["sample_rows"]].tolist()
        rep.kv_writes = [w.slots for w in runtime.kv_writes]
        rep.steps = [dict(call) for call in self.model.calls]
        rep.draft = out[:raw].tolist()
        return rep

class Observed:
    """The proposer's runnable (its ACLGraphWrapper), noting the forward context each call runs under: the dispatch and DP
    agreement _propose made. Attribute reads go to the wrapper."""

    def __init__(self, engine: AscendEngine, wrapper: Any) -> None:
        self.forward_context = engine.modules["vllm_forward_context"]
        self.wrapper = wrapper
        self.calls: list[dict[str, Any]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(context_record(self.forward_context.get_forward_context()))
        return self.wrapper(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapper, name)


def context_record(ctx: Any) -> dict[str, Any]:
    """What a forward context fixes for a graph: mode, key, token count, the DP agreement its collectives are sized by."""
    dp = ctx.dp_metadata
    return {"mode": ctx.cudagraph_runtime_mode.name, "desc": _key(ctx.batch_descriptor), "num_tokens": getattr(ctx, "num_tokens", None),
            "dp_tokens": None if dp is None else _ints(dp.num_tokens_across_dp_cpu)}


def _key(desc: Any) -> tuple[int, Optional[int], bool]:
    return (desc.num_tokens, desc.num_reqs, bool(desc.uniform)) if desc is not None else (0, None, False)


def _ints(t: Optional[torch.Tensor]) -> Optional[list[int]]:
    return None if t is None else [int(x) for x in t.tolist()]


def drive_world(engine: AscendEngine, cfg: AscendCheckConfig, world: World) -> tuple[list[RankDriver], list[AscendReplay]]:
    """Every rank's proposer captured, then the schedule's steps on every rank at once; the replays in iteration order."""
    dp = world.dp
    ranks_world = DPWorld(dp)
    engine.world = ranks_world
    _reset_caches(engine)
    acl = engine.modules["acl_graph"]
    acl._graph_params = acl._draft_graph_params = None  # each world's ranks set their own (RankTables)
    monitor = engine.modules["monitor"]
    drivers: list[Optional[RankDriver]] = [None] * dp

    def build(rank: int) -> None:
        drivers[rank] = RankDriver(engine, cfg, world, rank)
        drivers[rank].capture()

    # vLLM's current config is one process global: the ranks' configurations differ only in data_parallel_rank,
    # which nothing reading the current config (the attention backend's __init__ and replay-time probes) reads
    with engine.modules["vllm_config"].set_current_vllm_config(vllm_config(engine, cfg, world, 0)):
        monitor.set_cudagraph_capturing_enabled(True)
        ranks_world.run(build)
        monitor.set_cudagraph_capturing_enabled(False)  # capture_model's guard: a replay that captures lazily raises
        ranks = [d for d in drivers if d is not None]
        replays: list[AscendReplay] = []
        for t, dp_raw in enumerate(cfg.dp_schedule(dp)):
            replays += ranks_world.run(lambda rank, t=t, dp_raw=dp_raw: ranks[rank].step(t, dp_raw))
    engine.world = None
    return ranks, replays


def _reset_caches(engine: AscendEngine) -> None:
    """vllm-ascend caches per-process answers about the model (MoE or not) the first time it asks: a new world's
    configuration is asked afresh."""
    utils = engine.modules["utils"]
    for name in ("_IS_MOE_MODEL", "_IS_DRAFTER_MOE_MODEL", "_ENABLE_SP", "_HAS_LAYER_IDX"):
        if hasattr(utils, name):
            setattr(utils, name, None)
