"""The target model and the multi-layer EAGLE (MTP-style) draft model, TP-sharded.

Short and flat on purpose (gpt-fast / nanoGPT style). Every rank generates the same full
weights from the seed and keeps its shard, so any layout computes the same function
as TP1 up to the order of float sums.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from runners.attention.torch_ref import AttnMetadata
from runners.batch import ForwardBatch
from runners.config import ModelConfig
from runners.parallel.comm import Group
from runners.parallel.dp_attention import (
    RankContext,
    attn_tp_gather,
    attn_tp_scatter,
    dp_gather,
    dp_gather_sum_len,
    dp_scatter,
    dp_scatter_sum_len,
)
from runners.parallel.layout import Branch, DpPaddingMode, LayoutError, ParallelLayout
from runners.parallel.linear import merged_column_parallel, row_parallel, shard


def full_weight(cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Deterministic in (seed, name) alone, never in the layout or the order of creation."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + zlib.crc32(name.encode()))
    w = torch.randn(shape, generator=g, dtype=torch.float32) / shape[-1] ** 0.5
    return w.to(cfg.torch_dtype)


def check_model_fits_layout(cfg: ModelConfig, layout: ParallelLayout) -> None:
    a = layout.attn_tp_size
    if cfg.num_heads % a:
        raise LayoutError(f"layout.tp_size: attn_tp_size {a} must divide model.num_heads {cfg.num_heads}")
    if not (cfg.num_kv_heads % a == 0 or a % cfg.num_kv_heads == 0):
        raise LayoutError(f"layout.tp_size: attn_tp_size {a} and model.num_kv_heads {cfg.num_kv_heads} must divide one another")
    if cfg.vocab_size % layout.tp_size or cfg.intermediate_size % layout.tp_size:
        raise LayoutError(f"layout.tp_size: {layout.tp_size} must divide model.vocab_size and model.intermediate_size")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) in fp32, then the weight in x's dtype; torch's rms_norm is one kernel where it has a fused one."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * w


def norm_weight(cfg: ModelConfig, name: str) -> torch.Tensor:
    """Per-channel RMSNorm weight 1 + 0.1 * randn: a hidden state handed on before vs after a norm differs."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + zlib.crc32(name.encode()))
    return (1 + 0.1 * torch.randn(cfg.hidden_size, generator=g, dtype=torch.float32)).to(cfg.torch_dtype)


def rope_cos_sin_cache(cfg: ModelConfig) -> torch.Tensor:
    """[max_context_len, head_dim]: cos | sin of every position, as the engine's RotaryEmbedding caches them.

    Indexed by position inside the step body, with no clamp (the engine has none): a padded
    lane's position must be a row of the table, which the replay fill (position 0) guarantees;
    a position past the table raises on CPU (an out-of-bounds read on a GPU).
    """
    d = cfg.head_dim
    inv_freq = cfg.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = torch.arange(cfg.max_context_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """x [N, h, d] rotated by position (rotate-half convention), cos/sin gathered from the cache."""
    d = x.shape[-1]
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., : d // 2].float(), x[..., d // 2 :].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@dataclass
class HeadShard:
    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def head_shard(cfg: ModelConfig, attn_tp_rank: int, attn_tp_size: int) -> HeadShard:
    q_count = cfg.num_heads // attn_tp_size
    if attn_tp_size <= cfg.num_kv_heads:
        kv_count = cfg.num_kv_heads // attn_tp_size
        kv_start = attn_tp_rank * kv_count
    else:  # more ranks than KV heads: each KV head replicated over attn_tp_size / num_kv_heads ranks
        kv_count, kv_start = 1, attn_tp_rank // (attn_tp_size // cfg.num_kv_heads)
    return HeadShard(attn_tp_rank * q_count, q_count, kv_start, kv_count)


class DecoderLayer:
    """RMSNorm -> GQA attention with RoPE over the paged KV cache -> RMSNorm -> SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig, name: str, ctx: RankContext, kv_layer: int, qkv_in_features: Optional[int] = None):
        """qkv_in_features: the width qkv_proj reads (default hidden_size; an EAGLE3 draft layer reads 2 * hidden_size)."""
        self.cfg, self.ctx, self.kv_layer = cfg, ctx, kv_layer
        H, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        qkv_in = H if qkv_in_features is None else qkv_in_features
        layout = ctx.layout
        self.heads = hs = head_shard(cfg, ctx.attn_tp_rank, ctx.attn_tp_size)
        self.ln1 = norm_weight(cfg, f"{name}.ln1")
        self.ln2 = norm_weight(cfg, f"{name}.ln2")
        self.cos_sin_cache = rope_cos_sin_cache(cfg)
        wq = full_weight(cfg, f"{name}.q", (cfg.num_heads * d, qkv_in))
        wk = full_weight(cfg, f"{name}.k", (cfg.num_kv_heads * d, qkv_in))
        wv = full_weight(cfg, f"{name}.v", (cfg.num_kv_heads * d, qkv_in))
        wo = full_weight(cfg, f"{name}.o", (H, cfg.num_heads * d))
        # one fused qkv_proj of this rank's heads, as the engines' QKVParallelLinear (and gpt-fast's wqkv) hold it: one
        # GEMM, and no skinny k / v GEMM of kv_heads * head_dim columns for cuBLAS to pick a slow kernel for
        q_rows, kv_rows = slice(hs.q_start * d, (hs.q_start + hs.q_count) * d), slice(hs.kv_start * d, (hs.kv_start + hs.kv_count) * d)
        self.w_qkv = torch.cat([wq[q_rows], wk[kv_rows], wv[kv_rows]])
        self.qkv_split = (hs.q_count * d, hs.kv_count * d, hs.kv_count * d)
        self.wo = wo[:, hs.q_start * d : (hs.q_start + hs.q_count) * d].contiguous()

        gate = full_weight(cfg, f"{name}.gate", (inter, H))
        up = full_weight(cfg, f"{name}.up", (inter, H))
        down = full_weight(cfg, f"{name}.down", (H, inter))
        self.branch = layout.branch
        if layout.mlp_replicated:
            self.mlp_rank, self.mlp_size = 0, 1
        elif self.branch is Branch.MLP_TP_GATHER:
            self.mlp_rank, self.mlp_size = ctx.tp_rank, layout.tp_size
        else:
            self.mlp_rank, self.mlp_size = ctx.attn_tp_rank, ctx.attn_tp_size
        self.w_gate_up = merged_column_parallel((gate, up), self.mlp_rank, self.mlp_size)  # gate_up_proj: one GEMM
        self.w_down = row_parallel(down, self.mlp_rank, self.mlp_size)

    def attention(self, x: torch.Tensor, fb: ForwardBatch, attn, meta: AttnMetadata) -> torch.Tensor:
        """Returns the o_proj partial sum of this rank's heads."""
        n, d = x.shape[0], self.cfg.head_dim
        qkv = x @ self.w_qkv.T
        qk_width = self.qkv_split[0] + self.qkv_split[1]
        # q and k sit side by side in qkv_proj's output, so one rotation covers both heads' sets
        qk = apply_rope(qkv[:, :qk_width].view(n, self.heads.q_count + self.heads.kv_count, d), fb.positions, self.cos_sin_cache)
        q, k = qk.split([self.heads.q_count, self.heads.kv_count], dim=1)
        v = qkv[:, qk_width:].view(n, self.heads.kv_count, d)
        o = attn.forward(self.kv_layer, q, k, v, fb, meta)
        return o.reshape(n, self.heads.q_count * d) @ self.wo.T

    def mlp_local(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.w_gate_up.T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.w_down.T

    def forward(self, x: torch.Tensor, fb: ForwardBatch, attn, meta: AttnMetadata, attn_input: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x is the residual stream; attention reads rms_norm(x) unless the caller gives its input (an EAGLE3 draft layer:
        the normed token embeddings beside the normed hidden states)."""
        ctx, eps = self.ctx, self.cfg.rms_eps
        n = x.shape[0]
        partial = self.attention(rms_norm(x, self.ln1, eps) if attn_input is None else attn_input, fb, attn, meta)
        if self.branch is Branch.ATTN_TP_GATHER:
            a, res = attn_tp_scatter(ctx, partial, x)
            h = res + a
            out = h + self.mlp_local(rms_norm(h, self.ln2, eps))
            return attn_tp_gather(ctx, out, n)
        h = x + (ctx.comm.all_reduce(partial, Group.ATTN_TP) if ctx.attn_tp_size > 1 else partial)
        m_in = rms_norm(h, self.ln2, eps)
        if self.branch is Branch.MLP_TP_GATHER and fb.dp_padding_mode is DpPaddingMode.SUM_LEN:
            counts = fb.global_num_tokens_cpu
            gathered = dp_gather_sum_len(ctx, m_in, counts, fb.global_dp_buffer_len)
            m = dp_scatter_sum_len(ctx, self.mlp_local(gathered), counts, n, sharded=self.mlp_size > 1)
        elif self.branch is Branch.MLP_TP_GATHER:
            gathered = dp_gather(ctx, m_in, fb.global_dp_buffer_len)
            m = dp_scatter(ctx, self.mlp_local(gathered), n, sharded=self.mlp_size > 1)
        else:
            m = self.mlp_local(m_in)
            if self.mlp_size > 1:
                m = ctx.comm.all_reduce(m, Group.ATTN_TP)
        return h + m


class SharedHead:
    """Embedding (replicated) and the vocab-parallel lm_head shared by target and draft (EAGLE). An EAGLE3 draft shares
    the embedding and has an lm_head of its own over its reduced vocabulary (lm_name, lm_vocab)."""

    def __init__(self, cfg: ModelConfig, ctx: RankContext, lm_name: str = "lm_head", lm_vocab: Optional[int] = None):
        self.embed = full_weight(cfg, "embed", (cfg.vocab_size, cfg.hidden_size))
        lm = full_weight(cfg, lm_name, (cfg.vocab_size if lm_vocab is None else lm_vocab, cfg.hidden_size))
        self.lm_group, self.lm_rank, self.lm_size = lm_head_shards(ctx)
        self.lm_head = shard(lm, 0, self.lm_rank, self.lm_size)


def lm_head_shards(ctx: RankContext) -> tuple[Group, int, int]:
    """(group, rank, size) the vocab-parallel lm_head is sharded over: the world with the logits DP gather, else the
    attention-TP group."""
    if ctx.layout.logits_dp_gather:
        return Group.WORLD, ctx.tp_rank, lm_head_size(ctx.layout)
    return Group.ATTN_TP, ctx.attn_tp_rank, lm_head_size(ctx.layout)


def lm_head_size(layout: ParallelLayout) -> int:
    return layout.tp_size if layout.logits_dp_gather else layout.attn_tp_size


class DraftLayer:
    """One EAGLE/MTP step: fc over [norm(embed(token)); norm(hidden)] -> decoder layer -> norm."""

    def __init__(self, cfg: ModelConfig, step: int, ctx: RankContext):
        H = cfg.hidden_size
        self.cfg = cfg
        self.fc = full_weight(cfg, f"draft{step}.fc", (H, 2 * H))
        self.enorm = norm_weight(cfg, f"draft{step}.enorm")
        self.hnorm = norm_weight(cfg, f"draft{step}.hnorm")
        self.final_norm = norm_weight(cfg, f"draft{step}.final_norm")
        self.layer = DecoderLayer(cfg, f"draft{step}", ctx, kv_layer=step)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch, attn, meta) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.cfg.rms_eps
        x = torch.cat([rms_norm(embeds, self.enorm, eps), rms_norm(hidden.to(embeds.dtype), self.hnorm, eps)], dim=-1) @ self.fc.T
        out = self.layer.forward(x, fb, attn, meta)
        return out, rms_norm(out, self.final_norm, eps)


class DraftModel:
    def __init__(self, cfg: ModelConfig, num_layers: int, ctx: RankContext):
        check_model_fits_layout(cfg, ctx.layout)
        self.cfg, self.ctx = cfg, ctx
        self.head = SharedHead(cfg, ctx)
        self.layers = [DraftLayer(cfg, k, ctx) for k in range(num_layers)]


class TargetModel:
    def __init__(self, cfg: ModelConfig, ctx: RankContext, kv_layer_offset: int = 0):
        check_model_fits_layout(cfg, ctx.layout)
        self.cfg, self.ctx = cfg, ctx
        self.head = SharedHead(cfg, ctx)
        self.layers = [DecoderLayer(cfg, f"target{i}", ctx, kv_layer=kv_layer_offset + i) for i in range(cfg.num_target_layers)]
        self.norm = norm_weight(cfg, "target.norm")
        self.layers_to_capture: list[int] = []  # layers whose input (the residual stream) an EAGLE3 draft reads

    def set_eagle3_layers_to_capture(self, layer_ids: Sequence[int]) -> None:
        """An EAGLE3 draft reads the outputs of these layers: layer i's output is the residual stream at layer i + 1's
        input, where the forward captures it (SGLang's convention; -1 is the embeddings, at layer 0's input)."""
        self.layers_to_capture = [i + 1 for i in layer_ids]

    def forward(self, fb: ForwardBatch, attn, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (the hidden states the draft reads, normed last hidden states for the logits processor). The draft
        reads the last hidden states (pre-norm), or with layers to capture their residual streams concatenated in
        capture order, [N, len * H]: each is the full residual on every rank, a layer's collectives done."""
        x = self.head.embed[fb.input_ids]
        aux = []
        for i, layer in enumerate(self.layers):
            if i in self.layers_to_capture:
                aux.append(x)
            x = layer.forward(x, fb, attn, meta)
        return (torch.cat(aux, dim=-1) if aux else x), rms_norm(x, self.norm, self.cfg.rms_eps)
