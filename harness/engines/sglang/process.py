"""Per-layout process state: the engine's ServerArgs and parallel globals, set to describe one rank of a layout."""
from __future__ import annotations

import importlib
import inspect
from typing import Any

from harness.engines.sglang.config import EngineConfig
from harness.engines.sglang.errors import EngineAdapterError, require
from harness.engines.sglang.loader import Engine
from harness.engines.sglang.standins import FakeGroup
from runners.parallel.layout import ParallelLayout


def make_server_args(engine: Engine, layout: ParallelLayout, cfg: EngineConfig) -> Any:
    sa_mod = engine.modules["server_args"]
    ServerArgs = require(sa_mod, "ServerArgs", engine.version)
    # a dataclass up to 0.5.2x, a msgspec Struct later: both have a real signature
    names = set(inspect.signature(ServerArgs).parameters)
    kwargs: dict[str, Any] = dict(
        model_path="dummy",  # "dummy" short-circuits ServerArgs.__post_init__'s model and hardware probing
        device="cpu",
        tp_size=layout.tp_size,
        dp_size=layout.dp_size,
        enable_dp_attention=layout.enable_dp_attention,
        moe_dense_tp_size=layout.moe_dense_tp_size,
        enable_dp_lm_head=layout.enable_dp_lm_head,
        moe_a2a_backend=layout.moe_a2a_backend,
        enable_two_batch_overlap=layout.enable_two_batch_overlap,
        speculative_algorithm="EAGLE",
        speculative_num_steps=cfg.num_steps,
        speculative_eagle_topk=cfg.topk,
        speculative_num_draft_tokens=cfg.num_draft_tokens,
        max_running_requests=cfg.max_running_requests,
    )
    if "cuda_graph_bs" in names:
        kwargs["cuda_graph_bs"] = list(cfg.capture_bs)
    else:
        cgc = importlib.import_module("sglang.srt.model_executor.cuda_graph_config")
        Config, Phase = require(cgc, "CudaGraphConfig", engine.version), require(cgc, "PhaseConfig", engine.version)
        base = require(cgc, "default_cuda_graph_config", engine.version)()
        kwargs["cuda_graph_config"] = Config(
            decode=Phase(backend="full", max_bs=max(cfg.capture_bs), bs=list(cfg.capture_bs)), prefill=base.prefill
        )
    missing = [k for k in kwargs if k not in names]
    if missing:
        raise EngineAdapterError(f"sglang {engine.version}: ServerArgs has no field(s) {missing}; the adapter sets them to describe the layout")
    return ServerArgs(**kwargs)


def configure_process(engine: Engine, sa: Any, layout: ParallelLayout, tp_rank: int) -> None:
    """Make the engine's process-wide state describe `layout` as seen from `tp_rank`.

    By feature, not by version: releases with a runtime context get the server args
    published into it (with the rank bundle where publish() takes one: the topology then
    lives in the context); the others get set_global_server_args_for_scheduler. Where the
    topology is still read through parallel_state / dp_attention, those globals get fake
    groups of the right sizes and ranks.
    """
    attn_tp, attn_dp = layout.attn_tp_size, layout.attn_dp_size
    attn_tp_rank, attn_dp_rank = layout.attn_tp_rank(tp_rank), layout.attn_dp_rank(tp_rank)
    sa_mod, moe = engine.modules["server_args"], engine.modules["moe_utils"]
    rc = engine.modules.get("runtime_context")
    publish = getattr(rc, "publish", None) if rc is not None else None
    ranks_in_context = publish is not None and "ranks" in inspect.signature(publish).parameters
    if publish is not None:
        parallel = rc.get_parallel()
        if hasattr(parallel, "clear_stamp"):
            parallel.clear_stamp()  # each (layout, rank) re-publishes: drop the previous one's stamped ranks
        if ranks_in_context:
            publish(sa, role="scheduler", ranks=require(rc, "SpawnRanks", engine.version)(world_rank=tp_rank))
        else:
            publish(sa, role="scheduler")
    else:
        require(sa_mod, "set_global_server_args_for_scheduler", engine.version)(sa)
    if not ranks_in_context:
        ps, dpa = engine.modules["parallel_state"], engine.modules["dp_attention"]
        require(ps, "_TP", engine.version, "a parallel_state group global")
        ps._TP = FakeGroup("tp", layout.tp_size, tp_rank)
        attn_group = FakeGroup("attn_tp", attn_tp, attn_tp_rank)
        if hasattr(ps, "_ATTN_TP"):  # parallel_state owns the attention groups from 0.5.8 on; 0.5.7's dp_attention owns them
            ps._ATTN_TP = attn_group
            if hasattr(ps, "_ATTN_CP"):
                ps._ATTN_CP = FakeGroup("attn_cp", 1, 0)
        else:
            for name, value in (("_ATTN_TP_GROUP", attn_group), ("_ATTN_TP_RANK", attn_tp_rank), ("_ATTN_TP_SIZE", attn_tp)):
                require(dpa, name, engine.version, "the attention TP group, where parallel_state has none")
                setattr(dpa, name, value)
        if hasattr(ps, "_MOE_EP"):  # the expert-parallel group (the target verify runner asks its size: num_token_non_padded)
            ps._MOE_EP = FakeGroup("moe_ep", sa.ep_size, tp_rank % sa.ep_size)
        for name, value in (("_ATTN_DP_RANK", attn_dp_rank), ("_ATTN_DP_SIZE", attn_dp)):
            require(dpa, name, engine.version, "a dp_attention global")
            setattr(dpa, name, value)
        # present up to 0.5.1x only (later releases derive them from the published config)
        for name, value in (("_LOCAL_ATTN_DP_RANK", attn_dp_rank), ("_LOCAL_ATTN_DP_SIZE", attn_dp),
                            ("_ENABLE_DP_ATTENTION_FLAG", layout.enable_dp_attention)):
            if hasattr(dpa, name):
                setattr(dpa, name, value)
    # the MoE a2a backend (read by require_*_gather): seeded from the server args, or from the published context
    init_moe = require(moe, "initialize_moe_config", engine.version, "seeds the MoE a2a backend")
    init_moe(sa) if inspect.signature(init_moe).parameters else init_moe()
    if rc is not None and ranks_in_context:
        par = rc.get_parallel()
        got = (par.attn_tp_size, _attn_dp_read_back(par, layout, engine.version))
        if got != (attn_tp, attn_dp):
            raise EngineAdapterError(f"sglang {engine.version}: published layout {layout.describe()} reads back attn_tp/dp {got}, "
                                     f"expected {(attn_tp, attn_dp)}")


def _attn_dp_read_back(par: Any, layout: ParallelLayout, version: str) -> int:
    """The attention DP width as the published context says it: num_dp_ranks (0.5.22 on), attn_dp_size (0.5.21)."""
    try:
        return par.num_dp_ranks if layout.enable_dp_attention else 1
    except AttributeError:
        pass
    try:
        return par.attn_dp_size
    except (AttributeError, RuntimeError, ValueError) as e:
        raise EngineAdapterError(f"sglang {version}: the published parallel context has neither num_dp_ranks nor attn_dp_size ({e})") from e
