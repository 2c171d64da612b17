"""The target model's passes over the paged KV cache, and target-only greedy decoding (the P5 oracle).

Every target pass is an EXTEND over lanes of any length (a prefill of a whole prompt, a
one-token decode step) or a TARGET_VERIFY over tree lanes of num_draft_tokens nodes each (the
last token and the draft's tree, runners.verify). The gathered metadata comes from
`gathered_metadata` like every other batch with the token counts of every
DP group from the scheduler's MLP sync; a short or idle DP group pads its eager pass to the
largest group's token count (one padding lane) whenever some group is busy, so every rank
joins every collective with the same rows (runners.mlp_sync).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from runners import mlp_sync
from runners.attention import make_backend
from runners.attention.torch_ref import cache_positions, token_to_request
from runners.batch import EagleVerifyInput, ForwardBatch, ForwardMode
from runners.config import ModelConfig
from runners.dp_metadata import gathered_metadata
from runners.draft_extend import _move_tensors
from runners.logits import logits_processor
from runners.memory import ReqToTokenPool, TokenToKVPool, assign_out_cache_loc, lane_padding
from runners.model import TargetModel, head_shard
from runners.outputs import RunnerOutputs
from runners.parallel.dp_attention import RankContext, mlp_sync_batch_sizes
from runners.parallel.layout import DpPaddingMode, ParallelLayout
from runners.verify import tree_depths, tree_mask


@dataclass
class Lane:
    """Tokens of one request row at positions start .. start+len-1; their KV goes where the row points.

    A verify lane is a tree (runners.verify): `parents` per token (-1 for the root, token 0);
    token i then sits at position start + depth(i) and its KV at the row's column start + i.
    """

    req_pool_idx: int
    start: int
    tokens: Sequence[int]
    parents: Optional[Sequence[int]] = None

    @property
    def seq_len(self) -> int:
        return self.start + len(self.tokens)

    @property
    def positions(self) -> list[int]:
        if self.parents is None:
            return list(range(self.start, self.seq_len))
        return [self.start + d for d in tree_depths(self.parents)]


def verify_spec_info(lanes: Sequence[Lane], device: torch.device) -> Optional[EagleVerifyInput]:
    """The tree of a verify batch (every lane a tree of one size T), None for any other batch."""
    if not lanes or lanes[0].parents is None:
        return None
    T = len(lanes[0].tokens)
    if any(lane.parents is None or len(lane.tokens) != T for lane in lanes):
        raise ValueError(f"a verify batch has {T} tree nodes in every lane")
    return EagleVerifyInput(T, torch.stack([tree_mask(lane.parents) for lane in lanes]).to(device))


def extend_batch(ctx: RankContext, lanes: Sequence[Lane], dp_tokens: list[int], device: torch.device,
                 padding: DpPaddingMode = DpPaddingMode.MAX_LEN) -> ForwardBatch:
    """An EXTEND batch; logits for every token (for_logprob = tokens, as in DRAFT_EXTEND_V2). `padding`: how the DP
    groups' rows are gathered (SUM_LEN in a pass where a group extends, runners.mixed_modes)."""
    i64 = dict(dtype=torch.int64, device=device)
    lens = [len(lane.tokens) for lane in lanes]
    n = sum(lens)
    cat = lambda xs: torch.tensor([x for xs_ in xs for x in xs_], **i64) if n else torch.zeros(0, **i64)  # noqa: E731
    starts = [0]
    for m in lens[:-1]:
        starts.append(starts[-1] + m)
    meta = gathered_metadata(ctx.layout, dp_tokens, dp_tokens, ctx.attn_dp_rank, padding)
    tree = verify_spec_info(lanes, device)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND if tree is None else ForwardMode.TARGET_VERIFY,
        batch_size=len(lanes),
        input_ids=cat([lane.tokens for lane in lanes]),
        positions=cat([lane.positions for lane in lanes]),
        seq_lens=torch.tensor([lane.seq_len for lane in lanes], **i64),
        req_pool_indices=torch.tensor([lane.req_pool_idx for lane in lanes], **i64),
        out_cache_loc=torch.empty(n, **i64),  # written by the pass (assign_out_cache_loc)
        extend_seq_lens=torch.tensor(lens, **i64),
        extend_start_loc=torch.tensor(starts if lanes else [], **i64),
        spec_info=tree,
        extend_seq_lens_cpu=lens,
        extend_num_tokens=n,
        num_token_non_padded=n,
        seq_lens_sum=sum(lane.seq_len for lane in lanes),
        dp_padding_mode=padding,
        **meta.forward_batch_fields(device),
    )


@dataclass
class TargetOutput(RunnerOutputs):
    hidden: torch.Tensor  # [N, H] last layer, pre-norm: what the EAGLE draft consumes
    logits: torch.Tensor  # [N, V]
    rows_fed: Optional[torch.Tensor] = None  # scalar: rows this rank gave lm_head

    def lane_rows(self, lanes: Sequence[Lane]) -> list[slice]:
        out, at = [], 0
        for lane in lanes:
            out.append(slice(at, at + len(lane.tokens)))
            at += len(lane.tokens)
        return out


class TargetRunner:
    """One rank's target model with its KV pool (target layers), reading the shared request map."""

    def __init__(self, ctx: RankContext, cfg: ModelConfig, req_pool: ReqToTokenPool, num_slots: int,
                 device: torch.device, attention_backend: str = "torch", page_size: int = 1):
        self.ctx, self.cfg, self.device = ctx, cfg, device
        self.req_pool = req_pool
        self.model = TargetModel(cfg, ctx)
        if torch.device(device).type != "cpu":
            _move_tensors(self.model, torch.device(device))  # weights are generated on CPU (same bits everywhere)
        kv_heads = head_shard(cfg, ctx.attn_tp_rank, ctx.attn_tp_size).kv_count
        self.kv_pool = TokenToKVPool(cfg.num_target_layers, num_slots, kv_heads, cfg.head_dim, cfg.torch_dtype, device, page_size)
        self.attn = make_backend(attention_backend, req_pool=req_pool, kv_pool=self.kv_pool)
        self.passes = 0

    def forward(self, lanes: Sequence[Lane]) -> Optional[TargetOutput]:
        """One pass over this rank's lanes; None (and no collective) when every DP group is idle."""
        dp_tokens = mlp_sync_batch_sizes(self.ctx, sum(len(lane.tokens) for lane in lanes), self.device)
        if sum(dp_tokens) == 0:
            return None
        return self.forward_synced(lanes, dp_tokens)

    def forward_synced(self, lanes: Sequence[Lane], dp_tokens: list[int], padding: DpPaddingMode = DpPaddingMode.MAX_LEN) -> TargetOutput:
        """The eager pass once the MLP sync is done (the verify decides graph or eager from the same sync),
        padded to the DP maximum around the forward (runners.mlp_sync; a SUM_LEN pass is not padded)."""
        return self.run_batch(extend_batch(self.ctx, lanes, dp_tokens, self.device, padding), dp_tokens)

    def run_batch(self, fb: ForwardBatch, dp_tokens: list[int]) -> TargetOutput:
        """One eager pass over a built batch: the MLP-sync padding around the step body."""
        padded, pad = mlp_sync.prepare_mlp_sync_batch(fb, self.ctx.layout, dp_tokens, None, lane_padding(self.req_pool.padding).row)
        out = target_step(self, padded)
        (out.hidden, out.logits), _ = mlp_sync.post_forward_mlp_sync_batch(pad, (out.hidden, out.logits))
        self.passes += 1
        return out


def target_step(runner: TargetRunner, fb: ForwardBatch) -> TargetOutput:
    """The body shared by the eager pass, the verify graph's warm-up, capture and replay: the KV
    write slots are looked up from the request map here, inside the graph, as every index is."""
    token_to_req = token_to_request(fb)
    assign_out_cache_loc(runner.req_pool.req_to_token, fb.req_pool_indices, cache_positions(fb, token_to_req), token_to_req, fb.out_cache_loc,
                         runner.req_pool.pad_slot)
    meta = runner.attn.init_forward_metadata(fb)
    hidden, normed = runner.model.forward(fb, runner.attn, meta)
    lo = logits_processor(runner.ctx, runner.model.head, normed, fb)
    return TargetOutput(hidden, lo.next_token_logits, lo.rows_fed)


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """Per row: top-1 minus top-2 logit (how far greedy is from a tie)."""
    top = logits.float().topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


@dataclass
class GreedyOutput:
    tokens: list[int]  # generated tokens only
    margins: list[float]  # top-1 minus top-2 target logit at each generated token
    logprobs: list[float] = field(default_factory=list)  # the target's logprob of each generated token
    top_logprobs_idx: list[list[int]] = field(default_factory=list)  # at each generated token, the top_logprobs_num likeliest ids ...
    top_logprobs_val: list[list[float]] = field(default_factory=list)  # ... and their logprobs (target_greedy's top_logprobs_num)


def target_greedy(cfg: ModelConfig, prompts: Sequence[Sequence[int]], max_new: Sequence[int],
                  prepare=None, device: str | torch.device = "cpu", comm=None, top_logprobs_num: int = 0) -> list[GreedyOutput]:
    """Target-only greedy decoding at TP1, every request in one batch: a prefill, then one token a step.

    `prepare(target_model)` lets the caller apply the same weight adjustments as its engine;
    `comm` is a one-rank communicator (TP1 calls no collective, but code under test may touch it).
    Each generated token's logprob is kept, and the top_logprobs_num likeliest tokens at its position.
    """
    device = torch.device(device)
    ctx = RankContext(ParallelLayout(), 0, comm=comm)
    need = [len(p) + m for p, m in zip(prompts, max_new, strict=True)]
    req_pool = ReqToTokenPool(len(prompts) + 1, cfg.max_context_len, device)
    runner = TargetRunner(ctx, cfg, req_pool, 1 + sum(need), device)
    if prepare is not None:
        prepare(runner.model)
    rows, at = [], 1
    for m in need:
        idx = req_pool.alloc()
        req_pool.req_to_token[idx, :m] = torch.arange(at, at + m)
        rows.append(idx)
        at += m
    outs = [GreedyOutput([], []) for _ in prompts]
    seqs = [list(p) for p in prompts]
    lanes = [Lane(rows[i], 0, seqs[i]) for i in range(len(prompts))]
    while lanes:
        res = runner.forward(lanes)
        ends = [s.stop - 1 for s in res.lane_rows(lanes)]
        last = res.logits[ends]
        nxt, margins = last.argmax(dim=-1).tolist(), top2_margin(last).tolist()
        logprobs = torch.log_softmax(last.float(), dim=-1)
        chosen = logprobs.gather(1, last.argmax(dim=-1, keepdim=True))[:, 0].tolist()
        top_val, top_idx = logprobs.topk(top_logprobs_num, dim=-1)
        next_lanes = []
        for b, (lane, tok, mg) in enumerate(zip(lanes, nxt, margins, strict=True)):
            i = rows.index(lane.req_pool_idx)
            outs[i].tokens.append(int(tok))
            outs[i].margins.append(float(mg))
            outs[i].logprobs.append(chosen[b])
            if top_logprobs_num:
                outs[i].top_logprobs_idx.append(top_idx[b].tolist())
                outs[i].top_logprobs_val.append(top_val[b].tolist())
            seqs[i].append(int(tok))
            if len(outs[i].tokens) < max_new[i]:
                p = len(seqs[i]) - 1
                next_lanes.append(Lane(lane.req_pool_idx, p, [int(tok)]))
        lanes = next_lanes
    return outs
