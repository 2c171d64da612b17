"""The draft-extend step body (one helper for eager and graph paths) and the eager reference.

DRAFT_EXTEND_V2: every request runs num_tokens_per_bs tokens and every token gets logits;
then one row per request (the last accepted token) is selected for softmax + top-k, and
the next layer's inputs are written (MTP: the token sequence shifted by one, with the
draft's proposal in place of the first rejected token).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from runners import mlp_sync
from runners.attention import make_backend
from runners.attention.torch_ref import token_to_request
from runners.batch import EagleDraftInput, ForwardBatch, ForwardMode
from runners.config import DraftKind, ModelConfig, SpecConfig, draft_input_hidden_size, draft_model_config
from runners.dp_metadata import gathered_metadata
from runners.llama_eagle3 import Eagle3DraftModel
from runners.logits import LogitsOutput, logits_processor
from runners.memory import ReqToTokenPool, TokenToKVPool, assign_out_cache_loc, lane_padding
from runners.mlp_sync import SEQ_LEN_FILL_VALUE as SEQ_LEN_FILL_VALUE
from runners.model import DraftModel, head_shard
from runners.outputs import RunnerOutputs
from runners.parallel.dp_attention import RankContext


@dataclass
class DraftExtendInputs:
    """The live batch the scheduler hands one rank for one decode iteration."""

    input_ids: torch.Tensor  # [bs*T]
    positions: torch.Tensor  # [bs*T]
    seq_lens: torch.Tensor  # [bs]
    req_pool_indices: torch.Tensor  # [bs]
    hidden_states: torch.Tensor  # [bs*T, H]
    accept_lens: torch.Tensor  # [bs] num_accept_tokens, in 1..T
    dp_batch_sizes: list[int]  # every DP group's bs (from the MLP sync); [bs] without DP attention
    seq_lens_cpu: Optional[torch.Tensor] = None  # [bs] host copy of seq_lens, as the scheduler knows them
    return_logprob: bool = False  # the batch's flag as the scheduler hands it over; a draft pass runs with it reset
    accept_lens_cpu: Optional[torch.Tensor] = None  # [bs] host copy of accept_lens (the ragged layout is planned on the host)

    @property
    def bs(self) -> int:
        return int(self.seq_lens.shape[0])


def without_logprob(inp: DraftExtendInputs) -> DraftExtendInputs:
    """The batch as a draft pass runs it: return_logprob reset (runners.logprobs). The logprobs a request asked for are
    the target's; a draft pass that kept the flag could replay no graph (captured with it off) and ran eagerly."""
    return replace(inp, return_logprob=False) if inp.return_logprob else inp


@dataclass
class StepOutputs(RunnerOutputs):
    logits: torch.Tensor  # [N, V]
    hidden: torch.Tensor  # [N, H] layer output (pre-norm), the next layer's hidden input
    logprobs: torch.Tensor  # [bs, V] of the selected rows
    topk_p: torch.Tensor  # [bs, topk]
    topk_index: torch.Tensor  # [bs, topk]
    next_input_ids: torch.Tensor  # [N]
    rows_fed: torch.Tensor  # scalar: rows this rank gave lm_head

    def sliced(self, raw_bs: int, T: int) -> "StepOutputs":
        """The raw batch's rows: views, as the engine's replay returns them (runners.outputs)."""
        n = raw_bs * T
        return StepOutputs(
            self.logits[:n], self.hidden[:n], self.logprobs[:raw_bs], self.topk_p[:raw_bs], self.topk_index[:raw_bs],
            self.next_input_ids[:n], self.rows_fed,
        )


class DraftWorker:
    """One rank's draft model, KV pool and request pool: all of a rank's state in one object."""

    def __init__(
        self,
        ctx: RankContext,
        model_cfg: ModelConfig,
        spec_cfg: SpecConfig,
        num_layers: Optional[int] = None,
        attention_backend: str = "torch",
        device: str | torch.device = "cpu",
        max_reqs: int = 128,
        num_slots: int = 4096,
        build_model: bool = True,
    ):
        """build_model=False gives a worker with no weights or pools: enough for a graph
        runner's buffers and metadata (get_forward_batch, prepare_replay), which is what the
        fast metadata property drives at hundreds of examples per second."""
        self.ctx, self.spec = ctx, spec_cfg
        self.cfg = model_cfg = draft_model_config(model_cfg, spec_cfg)  # the draft's own: its rotary table
        self.device = torch.device(device)
        self.eagle3 = spec_cfg.draft is DraftKind.EAGLE3
        self.num_layers = 1 if self.eagle3 else spec_cfg.num_steps if num_layers is None else num_layers
        self.input_hidden_size = draft_input_hidden_size(model_cfg, spec_cfg)  # what the target hands the draft-extend
        self.vocab_size = model_cfg.vocab_size if spec_cfg.draft_vocab_size is None else spec_cfg.draft_vocab_size  # the logits' width
        self.pad = lane_padding(spec_cfg.padding_convention)  # what the graph runners' fills give padded lanes
        if not build_model:
            self.model = self.req_pool = self.kv_pool = self.attn = None
            return
        self.model = Eagle3DraftModel(model_cfg, spec_cfg, ctx) if self.eagle3 else DraftModel(model_cfg, self.num_layers, ctx)
        if self.device.type != "cpu":
            _move_tensors(self.model, self.device)  # weights are generated on CPU (same bits everywhere)
        kv_heads = head_shard(model_cfg, ctx.attn_tp_rank, ctx.attn_tp_size).kv_count
        self.req_pool = ReqToTokenPool(max_reqs, model_cfg.max_context_len, self.device, spec_cfg.padding_convention)
        self.kv_pool = TokenToKVPool(self.num_layers, num_slots, kv_heads, model_cfg.head_dim, model_cfg.torch_dtype, self.device,
                                     spec_cfg.page_size)
        self.attn = make_backend(attention_backend, req_pool=self.req_pool, kv_pool=self.kv_pool)

    @property
    def tokens_per_bs(self) -> int:
        return self.spec.num_tokens_per_bs

    @property
    def hot_token_id(self) -> Optional[torch.Tensor]:
        """Draft id -> target id of an EAGLE3 draft with a reduced vocabulary; None: the draft's ids are target ids."""
        return getattr(self.model, "hot_token_id", None)


_MODEL_MODULES = (DraftModel.__module__, Eagle3DraftModel.__module__)


def _move_tensors(obj, device: torch.device) -> None:
    """Move every tensor of a model object tree (runners.model, runners.llama_eagle3: layers, heads) to `device`."""
    for name, val in list(vars(obj).items()):
        if isinstance(val, torch.Tensor):
            setattr(obj, name, val.to(device))
        elif isinstance(val, list):
            for item in val:
                if type(item).__module__ in _MODEL_MODULES:
                    _move_tensors(item, device)
        elif type(val).__module__ in _MODEL_MODULES:
            _move_tensors(val, device)


def draft_extend_step(worker: DraftWorker, step: int, fb: ForwardBatch, attn=None) -> StepOutputs:
    """The body shared by the eager path, graph warm-up, capture and (simulated) replay.

    The KV write locations are looked up here, in the graph, from the request rows and
    positions (fb.out_cache_loc is their buffer): the replay fill of req_pool_indices and
    positions is what keeps a padded lane's writes in the padding slot. `attn`: the backend
    the layer attends with (default the worker's; a PIECEWISE graph breaks there).
    """
    T, bs = worker.tokens_per_bs, fb.batch_size
    attn = worker.attn if attn is None else attn
    assign_out_cache_loc(worker.req_pool.req_to_token, fb.req_pool_indices, fb.positions, token_to_request(fb), fb.out_cache_loc,
                         worker.req_pool.pad_slot)
    hidden, lo = draft_layer_logits(worker, step, fb, attn, attn.init_forward_metadata(fb))
    select_index = torch.arange(bs, device=hidden.device) * T + fb.spec_info.num_correct_drafts.to(torch.int64)
    logprobs, topk_p, topk_index = selected_top_k(lo, select_index, fb.spec_info.topk)
    shifted = torch.cat([fb.input_ids.view(bs, T)[:, 1:], topk_index[:, :1].to(fb.input_ids.dtype)], dim=1).reshape(-1)
    next_ids = shifted.index_put((select_index,), topk_index[:, 0].to(shifted.dtype))
    return StepOutputs(lo.next_token_logits, hidden, logprobs, topk_p, topk_index, next_ids, lo.rows_fed)


def draft_layer_logits(worker: DraftWorker, step: int, fb: ForwardBatch, attn, meta) -> tuple[torch.Tensor, LogitsOutput]:
    """Draft layer `step` over every token of the batch, then the logits processor: (layer output, logits)."""
    head = worker.model.head
    hidden, normed = worker.model.layers[step].forward(head.embed[fb.input_ids], fb.spec_info.hidden_states, fb, attn, meta)
    return hidden, logits_processor(worker.ctx, head, normed, fb)


def selected_top_k(lo: LogitsOutput, select_index: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-softmax and top-k of one selected row per request: (logprobs, topk_p, topk_index)."""
    logprobs = torch.log_softmax(lo.next_token_logits[select_index].float(), dim=-1)
    topk_p, topk_index = logprobs.exp().topk(topk, dim=-1)
    return logprobs, topk_p, topk_index


def tokens_and_logprob_tokens(dp_batch_sizes: list[int], T: int) -> tuple[list[int], list[int]]:
    """I7: our eager reference counts one logprob row per token (DRAFT_EXTEND_V2), like the graph."""
    tokens = [b * T for b in dp_batch_sizes]
    return tokens, list(tokens)


def eager_forward_batch(worker: DraftWorker, inp: DraftExtendInputs, input_ids: torch.Tensor, hidden: torch.Tensor) -> ForwardBatch:
    """All metadata from the live batch: what the graph must reproduce."""
    T, bs, dev = worker.tokens_per_bs, inp.bs, worker.device
    ctx = worker.ctx
    tokens, lp_tokens = tokens_and_logprob_tokens(inp.dp_batch_sizes, T)
    meta = gathered_metadata(ctx.layout, tokens, lp_tokens, ctx.attn_dp_rank)
    return ForwardBatch(
        forward_mode=ForwardMode.DRAFT_EXTEND_V2,
        batch_size=bs,
        input_ids=input_ids,
        positions=inp.positions,
        seq_lens=inp.seq_lens,
        req_pool_indices=inp.req_pool_indices,
        out_cache_loc=torch.empty(bs * T, dtype=torch.int64, device=dev),  # written by the step body
        extend_seq_lens=torch.full((bs,), T, dtype=torch.int64, device=dev),
        extend_start_loc=torch.arange(bs, device=dev, dtype=torch.int64) * T,
        spec_info=EagleDraftInput(hidden, inp.accept_lens - 1, inp.accept_lens, worker.spec.topk),
        extend_seq_lens_cpu=[T] * bs,
        extend_num_tokens=bs * T,
        num_token_non_padded=bs * T,
        seq_lens_sum=int(inp.seq_lens.sum()),
        return_logprob=inp.return_logprob,
        **meta.forward_batch_fields(dev),
    )


def draft_extend_forward(worker: DraftWorker, step: int, fb: ForwardBatch, dp_batch_sizes: list[int]) -> StepOutputs:
    """One eager step: the MLP-sync padding to the DP maximum, the step body, then the original rows."""
    T = worker.tokens_per_bs
    padded, pad = mlp_sync.prepare_mlp_sync_batch(fb, worker.ctx.layout, [b * T for b in dp_batch_sizes], T, worker.pad.row)
    out = draft_extend_step(worker, step, padded)
    (logits, hidden, next_ids), (logprobs, topk_p, topk_index) = mlp_sync.post_forward_mlp_sync_batch(
        pad, (out.logits, out.hidden, out.next_input_ids), (out.logprobs, out.topk_p, out.topk_index))
    return StepOutputs(logits, hidden, logprobs, topk_p, topk_index, next_ids, out.rows_fed)


def run_eager(worker: DraftWorker, inp: DraftExtendInputs) -> tuple[list[StepOutputs], list[ForwardBatch]]:
    """The reference: every draft layer in turn, each step's metadata from the live batch
    (the batches returned are the unpadded ones: what the scheduler handed the pass)."""
    ids, hidden = inp.input_ids, inp.hidden_states
    outs, batches = [], []
    for step in range(worker.num_layers):
        fb = eager_forward_batch(worker, inp, ids, hidden)
        out = draft_extend_forward(worker, step, fb, inp.dp_batch_sizes)
        outs.append(out)
        batches.append(fb)
        ids, hidden = out.next_input_ids, out.hidden
    return outs, batches


def with_step_inputs(inp: DraftExtendInputs, input_ids: torch.Tensor, hidden: torch.Tensor) -> DraftExtendInputs:
    return replace(inp, input_ids=input_ids, hidden_states=hidden)
