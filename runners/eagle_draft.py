"""The single-layer EAGLE draft decode: the step body shared by eager and graph, tree expansion, the proposal.

After the single-layer draft-extend has given every request its first top-k (depth 1) and the
hidden state of its selected row, the draft decode runs the one draft layer num_steps - 1 more
times, over bs * topk lanes (one per kept tree node), as the engine's EAGLE worker does:
each step selects the topk best of the topk * topk children of the kept nodes by
cumulative score (the product of the probabilities along the path), remembers each new node's
parent lane, feeds the new nodes with their parent's hidden state, and advances every lane's
position by one, in place, inside the graph.

KV: the write location of lane (b, t) at step s is req_to_token[req_pool_indices[b],
seq_lens[b] + t * (num_steps - 1) + s], looked up for every step at the start of the body
(`assign_draft_cache_locs`, gathers only) and read per step. A lane attends to its request's
prefix (positions < seq_len, through the request's req_to_token row) and to its own lane's
draft tokens of the steps so far, as the engine's multi-step draft backends do (a lane's
earlier tokens are those its slot column holds, not necessarily its tree ancestors), through
the worker's attention backend (the case's): `init_draft_decode_metadata(fb, locs, step)`. Since
the lookup runs in the graph, a padded lane's request row decides where it writes: the
replay fill (row 0, the padding row) sends it to the padding slot, and a stale row would
write into a live request's prefix.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from runners.batch import ForwardBatch, ForwardMode
from runners.dp_metadata import gathered_metadata
from runners.draft_extend import DraftWorker
from runners.llama_eagle3 import draft_to_target
from runners.logits import logits_processor
from runners.memory import write_slots
from runners.outputs import RunnerOutputs
from runners.scheduler import Proposal


@dataclass
class DraftDecodeSpecInfo:
    """The engine's EagleDraftInput in DECODE mode: the draft-extend's top-k and hidden state per request."""

    topk_p: torch.Tensor  # [bs, topk] probabilities of the depth-1 candidates
    topk_index: torch.Tensor  # [bs, topk] their token ids: draft ids (an EAGLE3 draft's reduced vocabulary), mapped in the body
    hidden_states: torch.Tensor  # [bs, H] the draft layer's output at each request's selected row
    topk: int = 1


@dataclass
class DraftDecodeInputs:
    """The live batch of one rank for one draft decode."""

    topk_p: torch.Tensor  # [bs, topk]
    topk_index: torch.Tensor  # [bs, topk]
    hidden_states: torch.Tensor  # [bs, H]
    seq_lens: torch.Tensor  # [bs] KV-ready prefix: the first draft token sits at position seq_len
    req_pool_indices: torch.Tensor  # [bs]
    positions: torch.Tensor  # [bs * topk] every lane starts at its request's seq_len
    dp_batch_sizes: list[int]  # every DP group's bs (from the MLP sync); [bs] without DP attention
    seq_lens_cpu: Optional[torch.Tensor] = None  # [bs] host copy of seq_lens (None: not kept)

    @property
    def bs(self) -> int:
        return int(self.seq_lens.shape[0])


@dataclass
class DraftDecodeOutputs(RunnerOutputs):
    """The draft tree of every request, per depth 1..S, and what the last forward fed lm_head."""

    tokens: torch.Tensor  # [bs, S, topk] the kept nodes of each depth (target ids, as child_index)
    parents: torch.Tensor  # [bs, S, topk] each node's parent lane at the previous depth (-1 at depth 1)
    scores: torch.Tensor  # [bs, S, topk] cumulative path probability of each kept node
    child_index: torch.Tensor  # [bs, S - 1, topk, topk] each kept node's top-k children (depth 1..S-1)
    child_p: torch.Tensor  # [bs, S - 1, topk, topk]
    step_logits: torch.Tensor  # [S - 1, bs * topk, V]
    logits: torch.Tensor  # [bs * topk, V] the last forward's
    rows_fed: torch.Tensor  # scalar: rows this rank gave lm_head in the last forward

    def sliced(self, raw_bs: int, topk: int) -> "DraftDecodeOutputs":
        """The raw batch's requests and lanes: views, as the engine's replay returns them (runners.outputs)."""
        n = raw_bs * topk
        per_req = {f: getattr(self, f)[:raw_bs] for f in ("tokens", "parents", "scores", "child_index", "child_p")}
        return DraftDecodeOutputs(**per_req, step_logits=self.step_logits[:, :n], logits=self.logits[:n], rows_fed=self.rows_fed)


def check_draft_window(num_steps: int, topk: int, num_tokens_per_bs: int) -> None:
    """The loop reserves num_tokens_per_bs positions past the prefix; the draft decode writes topk * (num_steps - 1) of them."""
    if topk * (num_steps - 1) > num_tokens_per_bs:
        raise ValueError(f"single-layer draft decode writes topk * (num_steps - 1) = {topk * (num_steps - 1)} slots past the prefix, "
                         f"more than the {num_tokens_per_bs} positions the loop reserves")


def assign_draft_cache_locs(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, topk: int,
                            num_steps: int, out: torch.Tensor, pad_slot: Optional[int] = None) -> torch.Tensor:
    """out[b, t, s] = req_to_token[req_pool_indices[b], seq_lens[b] + t * num_steps + s]: each lane's slots, all steps
    (a pad request's all pad_slot under vLLM's convention: runners.memory.write_slots)."""
    cols = torch.arange(topk * num_steps, device=seq_lens.device)
    locs = write_slots(req_to_token, req_pool_indices[:, None], seq_lens[:, None] + cols[None, :], pad_slot)
    return out.copy_(locs.reshape(-1))


def select_top_k_tokens(i: int, topk_p: torch.Tensor, topk_index: torch.Tensor, hidden: torch.Tensor,
                        scores: Optional[torch.Tensor], topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tree expansion. Returns (input ids [bs*k], hidden [bs*k, H], scores [bs, k], parent lane [bs, k]).

    Step 0 keeps every depth-1 candidate (scores = their probabilities, parents -1), each lane
    fed its request's hidden state. Step i > 0: topk_p / topk_index are [bs*k, k], the children
    of each kept lane; a child's score is its parent's times its own probability; the topk best
    of the k * k children are kept, and each takes its parent lane's hidden state.
    """
    bs = topk_p.shape[0] // (1 if i == 0 else topk)
    if i == 0:
        parents = torch.full((bs, topk), -1, dtype=torch.int64, device=topk_p.device)
        return topk_index.reshape(-1), hidden.repeat_interleave(topk, dim=0), topk_p, parents
    expand = scores[:, :, None] * topk_p.view(bs, topk, topk)
    best_p, best = expand.flatten(1).topk(topk, dim=-1)
    input_ids = torch.gather(topk_index.view(bs, topk * topk), 1, best).reshape(-1)
    parents = best // topk
    lane = (parents + torch.arange(bs, device=best.device)[:, None] * topk).reshape(-1)
    return input_ids, hidden[lane], best_p, parents


def require_draft_decode(attn) -> None:
    """A single-layer draft decode attends through `attn.init_draft_decode_metadata`: refuse a backend without it
    when the draft is built, never substitute another backend's attention for it."""
    if not callable(getattr(attn, "init_draft_decode_metadata", None)):
        raise ValueError(f"attention backend {getattr(attn, 'name', type(attn).__name__)!r} has no init_draft_decode_metadata(fb, locs, step): "
                         "it cannot run the single-layer EAGLE draft decode (draft = \"single_layer\" with num_steps > 1)")


def advance_positions(positions: torch.Tensor) -> None:
    """In place, every lane (padded ones too): the next step's tokens sit one position further."""
    positions.add_(1)


def draft_decode_forward(worker: DraftWorker, fb: ForwardBatch) -> DraftDecodeOutputs:
    """The body shared by the eager reference, graph warm-up, capture and (simulated) replay; it attends with the
    worker's backend (the case's), each step's metadata from `init_draft_decode_metadata`.

    fb.out_cache_loc holds bs * topk * (S - 1) slots (written here), fb.positions the lanes'
    positions (advanced here, in place, once per forward).
    """
    info: DraftDecodeSpecInfo = fb.spec_info
    k, S, bs = info.topk, worker.spec.num_steps, fb.batch_size
    n, steps = bs * k, S - 1
    layer, head, ctx, attn = worker.model.layers[0], worker.model.head, worker.ctx, worker.attn
    locs = assign_draft_cache_locs(worker.req_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, k, steps, fb.out_cache_loc,
                                   worker.req_pool.pad_slot).view(bs, k, steps)
    per_step = locs.permute(2, 0, 1).reshape(steps, n)
    hot = worker.hot_token_id  # an EAGLE3 draft's top-k are draft ids: mapped to target ids before they are embedded or kept
    topk_p, topk_index, hidden, scores = info.topk_p, draft_to_target(hot, info.topk_index), info.hidden_states, None
    tokens, parents, score_list, child_index, child_p, step_logits, rows_fed = [], [], [], [], [], [], None
    for i in range(S):
        input_ids, hidden, scores, parent = select_top_k_tokens(i, topk_p, topk_index, hidden, scores, k)
        tokens.append(input_ids.view(bs, k))
        parents.append(parent)
        score_list.append(scores)
        if i == S - 1:
            break
        step_fb = replace(fb, input_ids=input_ids, out_cache_loc=per_step[i])
        meta = attn.init_draft_decode_metadata(step_fb, locs, i)
        hidden, normed = layer.forward(head.embed[input_ids], hidden, step_fb, attn, meta)
        lo = logits_processor(ctx, head, normed, step_fb)
        probs = torch.softmax(lo.next_token_logits.float(), dim=-1)
        topk_p, topk_index = probs.topk(k, dim=-1)
        topk_index = draft_to_target(hot, topk_index)
        child_p.append(topk_p.view(bs, k, k))
        child_index.append(topk_index.view(bs, k, k))
        step_logits.append(lo.next_token_logits)
        rows_fed = lo.rows_fed
        advance_positions(fb.positions)
    return DraftDecodeOutputs(
        torch.stack(tokens, 1), torch.stack(parents, 1), torch.stack(score_list, 1),
        torch.stack(child_index, 1), torch.stack(child_p, 1), torch.stack(step_logits), step_logits[-1], rows_fed,
    )


def decode_forward_batch(worker: DraftWorker, bs: int, positions: torch.Tensor, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor,
                         out_cache_loc: torch.Tensor, input_ids: torch.Tensor, spec_info: DraftDecodeSpecInfo, seq_lens_sum: int,
                         tokens_per_dp_rank: list[int]) -> ForwardBatch:
    """A DECODE batch of bs * topk lanes; the gathered metadata counts lanes (tokens), never requests."""
    meta = gathered_metadata(worker.ctx.layout, tokens_per_dp_rank, list(tokens_per_dp_rank), worker.ctx.attn_dp_rank)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=bs,
        input_ids=input_ids,
        positions=positions,
        seq_lens=seq_lens,
        req_pool_indices=req_pool_indices,
        out_cache_loc=out_cache_loc,
        extend_seq_lens=seq_lens[:0],  # DECODE extends nothing
        extend_start_loc=seq_lens[:0],
        spec_info=spec_info,
        num_token_non_padded=int(input_ids.shape[0]),
        seq_lens_sum=seq_lens_sum,
        **meta.forward_batch_fields(worker.device),
    )


def run_eager_decode(worker: DraftWorker, inp: DraftDecodeInputs) -> DraftDecodeOutputs:
    """The reference: the same body over the live batch, metadata from the live DP sizes."""
    k, S, bs, dev = worker.spec.topk, worker.spec.num_steps, inp.bs, worker.device
    i64 = dict(dtype=torch.int64, device=dev)
    fb = decode_forward_batch(
        worker, bs, inp.positions.clone(), inp.seq_lens, inp.req_pool_indices, torch.empty(bs * k * (S - 1), **i64),
        torch.zeros(bs * k, **i64), DraftDecodeSpecInfo(inp.topk_p, inp.topk_index, inp.hidden_states, k),
        int(inp.seq_lens.sum()), [b * k for b in inp.dp_batch_sizes],
    )
    return draft_decode_forward(worker, fb)


def tree_proposals(first_topk: torch.Tensor, out: Optional[DraftDecodeOutputs], num_steps: int) -> list[Proposal]:
    """Each request's best path (highest cumulative score at depth S, parents traced back) as the chain,
    and per depth the chain parent's top-k children with the chain's token first (runners.verify's siblings)."""
    first = first_topk.tolist()
    if out is None or num_steps == 1:
        return [Proposal([c[0]], [c]) for c in first]
    tokens, parents, scores = out.tokens.tolist(), out.parents.tolist(), out.scores.tolist()
    children = out.child_index.tolist()
    props = []
    for b in range(len(first)):
        lane = max(range(len(scores[b][-1])), key=lambda j: (scores[b][-1][j], -j))
        lanes = [lane]
        for d in range(num_steps - 1, 0, -1):
            lane = parents[b][d][lane]
            lanes.append(lane)
        lanes.reverse()
        chain = [int(tokens[b][d][lanes[d]]) for d in range(num_steps)]
        cands = [_first(first[b], chain[0])]
        cands += [_first(children[b][d - 1][lanes[d - 1]], chain[d]) for d in range(1, num_steps)]
        props.append(Proposal(chain, cands))
    return props


def _first(options: list[int], token: int) -> list[int]:
    rest = list(options)
    rest.remove(token)
    return [token] + rest
