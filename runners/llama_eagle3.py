"""The EAGLE3 draft model (SGLang's models/llama_eagle3.py, LlamaForCausalLMEagle3), TP-sharded like every model here.

What differs from the EAGLE draft of runners.model:

* its hidden input is the target's auxiliary hidden states: the residual streams of several target layers,
  concatenated ([N, num_aux * H], runners.model.TargetModel.set_eagle3_layers_to_capture). `fc` projects them back to
  H, and only them: the engine applies fc when the hidden input is wider than the token embeddings, so the draft
  decode, which feeds the layer its own output (H wide), skips it;
* its one decoder layer reads [input_layernorm(embeddings); hidden_norm(hidden)] (qkv_proj over 2H), with the
  projected hidden state as its residual;
* it drafts over a reduced vocabulary: its lm_head has draft_vocab_size rows, and a draft id d is target id
  hot_token_id[d]. The checkpoint stores the table as differences, d2t[d] = target id - d (SGLang's load_weights
  adds arange back); ours is drawn from the seed (`d2t_table`). The draft's top-k ids are mapped to target ids before
  anything embeds or verifies them (runners.eagle_draft), since the draft embeds target ids with the target's table.
"""
from __future__ import annotations

import zlib
from typing import Optional

import torch

from runners.batch import ForwardBatch
from runners.config import ModelConfig, SpecConfig, check_spec_fits_model, draft_input_hidden_size
from runners.model import (
    DecoderLayer,
    SharedHead,
    check_model_fits_layout,
    full_weight,
    lm_head_size,
    norm_weight,
    rms_norm,
)
from runners.parallel.dp_attention import RankContext
from runners.parallel.layout import LayoutError, ParallelLayout
from runners.parallel.linear import shard


def d2t_table(cfg: ModelConfig, draft_vocab_size: int) -> torch.Tensor:
    """The checkpoint's draft-to-target table, as differences: draft id d is target id d + d2t[d]. The draft's
    vocabulary is draft_vocab_size distinct target ids drawn from the seed, ascending (so every difference is >= 0,
    as in the published EAGLE3 checkpoints, whose hot tokens are sorted)."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + zlib.crc32(b"eagle3.d2t"))
    hot = torch.randperm(cfg.vocab_size, generator=g)[:draft_vocab_size].sort().values
    return hot - torch.arange(draft_vocab_size)


def hot_token_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Draft id -> target id, from the stored differences (SGLang's hot_token_id = d2t + arange)."""
    return d2t + torch.arange(d2t.shape[0], dtype=d2t.dtype)


def draft_to_target(hot_token_id: Optional[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """The draft's token ids as target ids: the gather the worker runs on every top-k (inside the graph); a draft
    without a reduced vocabulary drafts target ids already."""
    return ids if hot_token_id is None else hot_token_id[ids]


def check_draft_vocab_shards(layout: ParallelLayout, spec: SpecConfig) -> None:
    """The reduced vocabulary's lm_head rows shard over the draft layout's lm_head ranks (`layout`: the draft's)."""
    n = lm_head_size(layout)
    if spec.draft_vocab_size is not None and spec.draft_vocab_size % n:
        raise LayoutError(f"spec.draft_vocab_size: a multiple of the {n} ranks the EAGLE3 lm_head is sharded over, got {spec.draft_vocab_size}")


class Eagle3DraftLayer:
    """fc (aux hidden states only) -> the decoder layer over [norm(embeds); norm(hidden)] -> the final norm."""

    def __init__(self, cfg: ModelConfig, spec: SpecConfig, ctx: RankContext):
        H = cfg.hidden_size
        self.cfg = cfg
        self.fc = full_weight(cfg, "eagle3.fc", (H, draft_input_hidden_size(cfg, spec)))
        self.hidden_norm = norm_weight(cfg, "eagle3.hidden_norm")
        self.final_norm = norm_weight(cfg, "eagle3.final_norm")
        self.layer = DecoderLayer(cfg, "eagle3", ctx, kv_layer=0, qkv_in_features=2 * H)  # its ln1 is the input_layernorm

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch, attn, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (the layer's output, pre-norm: what the next draft step reads; normed, for the logits)."""
        eps = self.cfg.rms_eps
        hidden = hidden.to(embeds.dtype)
        if hidden.shape[-1] != embeds.shape[-1]:  # the target's aux hidden states (draft-extend), not the draft's own
            hidden = hidden @ self.fc.T
        x = torch.cat([rms_norm(embeds, self.layer.ln1, eps), rms_norm(hidden, self.hidden_norm, eps)], dim=-1)
        out = self.layer.forward(hidden, fb, attn, meta, attn_input=x)
        return out, rms_norm(out, self.final_norm, eps)


class Eagle3DraftModel:
    """LlamaForCausalLMEagle3: the target's embedding, one EAGLE3 layer, an lm_head over draft_vocab_size rows and the
    draft-to-target table. The same interface as runners.model.DraftModel (cfg, ctx, head, layers), plus hot_token_id."""

    def __init__(self, cfg: ModelConfig, spec: SpecConfig, ctx: RankContext):
        check_model_fits_layout(cfg, ctx.layout)
        check_spec_fits_model(cfg, spec)
        self.cfg, self.ctx = cfg, ctx
        vocab = cfg.vocab_size if spec.draft_vocab_size is None else spec.draft_vocab_size
        check_draft_vocab_shards(ctx.layout, spec)
        self.head = SharedHead(cfg, ctx, lm_name="eagle3.lm_head", lm_vocab=vocab)
        self.layers = [Eagle3DraftLayer(cfg, spec, ctx)]
        self.vocab_size = vocab
        # None without a reduced vocabulary: the draft's ids are target ids (SGLang: no d2t in the checkpoint)
        self.hot_token_id = None if spec.draft_vocab_size is None else hot_token_ids(d2t_table(cfg, vocab))

    def align_to_target(self, embed_gain: float, hidden_scale: float, branch_scale: float, self_attention_gain: float = 8.0) -> None:
        """Random weights would accept nothing; this makes the draft predict roughly what the target does (the loop's
        Alignment, the same on every rank). An EAGLE3 layer sees the token it reads only through attention (its residual
        is the projected target state of the previous token), so the alignment routes the token embedding through
        attention: each query head reads its KV head's slice of the normed embedding times self_attention_gain, each key
        the same slice, each value that slice times embed_gain, and o_proj puts every head's output back on its slice
        (shared by the heads of a KV group). A token's own key then outscores the others (a random key of another token
        correlates weakly with it), so the attention output is mostly the token's own embedding. fc is scaled by
        hidden_scale and the MLP's down projection by branch_scale; the lm_head is the target's rows of the draft's
        vocabulary (as SGLang cuts a shared head to a token map's rows) and the final norm the target's."""
        cfg, layer = self.cfg, self.layers[0]
        H, d = cfg.hidden_size, cfg.head_dim
        dec, hs = layer.layer, layer.layer.heads
        group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
        eye = torch.eye(d, dtype=dec.w_qkv.dtype)
        w_qkv = torch.zeros_like(dec.w_qkv)
        wo = torch.zeros_like(dec.wo)
        q_rows, kv_rows = hs.q_count * d, hs.kv_count * d
        for i in range(hs.q_count):  # local query head i: global head q_start + i, in KV group (q_start + i) // group
            g = (hs.q_start + i) // group
            w_qkv[i * d:(i + 1) * d, g * d:(g + 1) * d] = self_attention_gain * eye
            wo[g * d:(g + 1) * d, i * d:(i + 1) * d] = eye / group
        for j in range(hs.kv_count):
            g = hs.kv_start + j
            w_qkv[q_rows + j * d:q_rows + (j + 1) * d, g * d:(g + 1) * d] = eye
            w_qkv[q_rows + kv_rows + j * d:q_rows + kv_rows + (j + 1) * d, g * d:(g + 1) * d] = embed_gain * eye
        dec.w_qkv.copy_(w_qkv)
        dec.wo.copy_(wo)
        dec.w_down.mul_(branch_scale)
        layer.fc.mul_(hidden_scale)
        target_lm = full_weight(cfg, "lm_head", (cfg.vocab_size, H))
        rows = target_lm if self.hot_token_id is None else target_lm[self.hot_token_id]
        self.head.lm_head.copy_(shard(rows, 0, self.head.lm_rank, self.head.lm_size))
        layer.final_norm.copy_(norm_weight(cfg, "target.norm"))
