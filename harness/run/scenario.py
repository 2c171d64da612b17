"""Deterministic draft-extend scenarios, materialised identically on any layout.

A scenario is a global description (requests per DP group per iteration, their prefix
lengths and accept lengths, a seed). Token ids, target hidden states and the prefix KV
of every draft layer are drawn per request from the seed alone, and each rank keeps
its KV-head slice, so every layout sees bitwise-identical inputs and TP1 over the union
of all DP groups' requests is the oracle (P4).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace

import torch

from runners.attention.kinds import AttentionBackend
from runners.config import ModelConfig, SpecConfig, draft_input_hidden_size
from runners.draft_extend import DraftExtendInputs, DraftWorker
from runners.draft_parallel import served_dp_rank
from runners.model import head_shard
from runners.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class RequestSpec:
    rid: int
    prefix_len: int
    accept_len: int  # 1..T


@dataclass(frozen=True)
class Iteration:
    """One decode iteration: the requests of each DP group (an empty tuple is an idle group)."""

    per_dp: tuple[tuple[RequestSpec, ...], ...]

    @property
    def dp_batch_sizes(self) -> list[int]:
        return [len(r) for r in self.per_dp]

    def all_requests(self) -> tuple[RequestSpec, ...]:
        return tuple(r for group in self.per_dp for r in group)


@dataclass(frozen=True)
class Scenario:
    model: ModelConfig
    spec: SpecConfig
    layout: ParallelLayout
    iterations: tuple[Iteration, ...]
    seed: int = 0
    attention_backend: AttentionBackend = AttentionBackend.TORCH
    name: str = "scenario"

    def as_tp1(self) -> "Scenario":
        """The oracle: TP1, every DP group's requests in one batch, same iterations."""
        its = tuple(Iteration((it.all_requests(),)) for it in self.iterations)
        spec = replace(self.spec, draft_tp_size=None)  # the TP1 draft: the draft's own TP size is the target's there
        return Scenario(self.model, spec, ParallelLayout(), its, self.seed, self.attention_backend, self.name + "@tp1")


def _gen(seed: int, *key: object) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 7919 + zlib.crc32(repr(key).encode()))


def request_tensors(sc: Scenario, req: RequestSpec) -> dict[str, torch.Tensor]:
    cfg, T = sc.model, sc.spec.num_tokens_per_bs
    g = _gen(sc.seed, "req", req.rid)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    hidden = torch.randn(T, draft_input_hidden_size(cfg, sc.spec), generator=g).to(cfg.torch_dtype)  # EAGLE3: the captured layers
    return {"input_ids": ids, "hidden_states": hidden}


def prefix_kv(sc: Scenario, req: RequestSpec, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = sc.model
    g = _gen(sc.seed, "kv", req.rid, layer)
    shape = (req.prefix_len, cfg.num_kv_heads, cfg.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@dataclass
class MaterializedBatch:
    inputs: DraftExtendInputs
    rids: list[int]
    slots: list[list[int]] = field(default_factory=list)


def materialize(worker: DraftWorker, sc: Scenario, it: Iteration) -> MaterializedBatch:
    """Allocate pools and write this DP group's requests into one rank's worker."""
    ctx, cfg, T = worker.ctx, sc.model, sc.spec.num_tokens_per_bs
    reqs = it.per_dp[served_dp_rank(ctx)]
    shard = head_shard(cfg, ctx.attn_tp_rank, ctx.attn_tp_size)
    kv_sl = slice(shard.kv_start, shard.kv_start + shard.kv_count)
    dev = worker.device
    ids, pos, hidden, seq_lens, pool_idx, accept, all_slots = [], [], [], [], [], [], []
    for req in reqs:
        if req.prefix_len + T > cfg.max_context_len:
            raise ValueError(f"request {req.rid}: prefix_len {req.prefix_len} + {T} tokens exceeds max_context_len {cfg.max_context_len}")
        idx = worker.req_pool.alloc()
        slots = worker.kv_pool.alloc(req.prefix_len + T)
        worker.req_pool.req_to_token[idx, : len(slots)] = torch.tensor(slots, device=dev)
        for layer in range(worker.num_layers):
            k, v = prefix_kv(sc, req, layer)
            loc = torch.tensor(slots[: req.prefix_len], dtype=torch.int64, device=dev)
            worker.kv_pool.write(layer, loc, k[:, kv_sl].to(dev), v[:, kv_sl].to(dev))
        t = request_tensors(sc, req)
        ids.append(t["input_ids"])
        hidden.append(t["hidden_states"])
        pos.append(torch.arange(req.prefix_len, req.prefix_len + T))
        seq_lens.append(req.prefix_len + T)
        pool_idx.append(idx)
        accept.append(req.accept_len)
        all_slots.append(slots)

    def cat(xs: list[torch.Tensor], empty_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return (torch.cat(xs) if xs else torch.zeros(empty_shape, dtype=dtype)).to(dev)

    i64 = torch.int64
    inputs = DraftExtendInputs(
        input_ids=cat(ids, (0,), i64),
        positions=cat(pos, (0,), i64),
        seq_lens=torch.tensor(seq_lens, dtype=i64, device=dev),
        req_pool_indices=torch.tensor(pool_idx, dtype=i64, device=dev),
        hidden_states=cat(hidden, (0, worker.input_hidden_size), cfg.torch_dtype),
        accept_lens=torch.tensor(accept, dtype=i64, device=dev),
        dp_batch_sizes=[len(reqs)],  # replaced by the MLP sync (a collective) when the rank runs
        seq_lens_cpu=torch.tensor(seq_lens, dtype=i64),
    )
    return MaterializedBatch(inputs, [r.rid for r in reqs], all_slots)


def release(worker: DraftWorker, batch: MaterializedBatch) -> None:
    for idx, slots in zip(batch.inputs.req_pool_indices.tolist(), batch.slots, strict=True):
        worker.req_pool.release(int(idx))
        worker.kv_pool.release(slots)
