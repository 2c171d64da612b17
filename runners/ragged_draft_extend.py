"""The ragged draft-extend: each request contributes only its accepted tokens, packed back to back, and the row of each
request's last token is a gather index (vLLM's last_token_indices) rather than a per-lane offset.

SGLang's DRAFT_EXTEND_V2 (runners.draft_extend) runs num_tokens_per_bs tokens per request and selects, inside the
graph, row i * T + num_correct_drafts[i]: a lane's selection can only ever land in its own lane. vLLM's drafter prefill
(v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py, prepare_prefill_inputs) instead writes, per request, the
absolute token row of its last accepted token into a persistent [max_num_reqs] buffer, pads the buffer's tail for the
CUDA graph, and gathers the rows to sample from through it. An absolute row is another request's row when it is stale:
here the step body also scatters each request's proposal into the next step's token ids through that index (the chain
of the multi-layer draft), so a padded lane left on a larger batch's index overwrites a live request's next token.

Layout (`RaggedPlan`, built on the host from the accept lengths the scheduler knows): request i's accepted tokens sit
at packed rows [starts[i], starts[i] + accept_lens[i]), its last at starts[i] + accept_lens[i] - 1. The scheduler's
batch (`DraftExtendInputs`) is request-major, T rows per request; `pack` maps each packed row to its row there. The
outputs are handed back request-major (`unpacked`), rows past a request's accept length zero, so that every consumer
(the proposer, the loop's report, the harness) reads one layout whatever the draft-extend's shape.

Tokens of a graph bucket past every lane's extent (the bucket holds bs * T rows, the batch fewer) belong to no request:
their KV write slot is the convention's padding slot (`ragged_write_slots`), never a slot of the lane they sit behind.
Padded lanes own one padding token each and select it (`RaggedPlan.padded`), so their proposals land on padding rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from runners.attention.torch_ref import token_to_request
from runners.batch import EagleDraftInput, ForwardBatch, ForwardMode, host_copy
from runners.dp_metadata import gathered_metadata
from runners.draft_extend import DraftExtendInputs, DraftWorker, StepOutputs, draft_layer_logits, selected_top_k
from runners.memory import write_slots


@dataclass(frozen=True)
class RaggedPlan:
    """Where each request's accepted tokens go in the packed layout (host values)."""

    accept_lens: tuple[int, ...]
    T: int

    @classmethod
    def of(cls, inp: DraftExtendInputs, T: int) -> "RaggedPlan":
        return cls(tuple(int(a) for a in host_copy(inp.accept_lens_cpu, inp.accept_lens).tolist()), T)

    @property
    def bs(self) -> int:
        return len(self.accept_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.accept_lens)

    @property
    def starts(self) -> list[int]:
        out, at = [], 0
        for a in self.accept_lens:
            out.append(at)
            at += a
        return out

    @property
    def pack(self) -> list[int]:
        """Packed row -> its row in the request-major layout (T rows per request)."""
        return [i * self.T + j for i, a in enumerate(self.accept_lens) for j in range(a)]

    @property
    def last_token_indices(self) -> list[int]:
        return [s + a - 1 for s, a in zip(self.starts, self.accept_lens, strict=True)]

    def padded(self, bs: int) -> tuple[list[int], list[int], list[int]]:
        """(extend_start_loc, extend_seq_lens, last_token_indices) of lanes raw_bs .. bs-1 of a bucket: padded lane j owns
        the one padding token num_tokens + (j - raw_bs) and selects it (a row no live token holds; every one is inside the
        bucket, since num_tokens <= raw_bs * T)."""
        starts = [self.num_tokens + j for j in range(bs - self.bs)]
        return starts, [1] * len(starts), list(starts)

    def index(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.pack, dtype=torch.int64, device=device)


def unpacked(out: StepOutputs, plan: RaggedPlan, device: torch.device) -> StepOutputs:
    """A packed step's outputs request-major (T rows per request, rows past a request's accept length zero), the live
    requests only. Per-token outputs are gathered through the plan's index; per-request ones are the first lanes."""
    rows, n, bs = plan.index(device), plan.num_tokens, plan.bs

    def per_token(t: torch.Tensor) -> torch.Tensor:
        out_t = t.new_zeros((bs * plan.T, *t.shape[1:]))
        return out_t.index_copy_(0, rows, t[:n])

    return StepOutputs(per_token(out.logits), per_token(out.hidden), out.logprobs[:bs], out.topk_p[:bs], out.topk_index[:bs],
                       per_token(out.next_input_ids), out.rows_fed)


def ragged_write_slots(worker: DraftWorker, fb: ForwardBatch, token_to_req: torch.Tensor) -> torch.Tensor:
    """Every token's KV write slot into fb.out_cache_loc: its lane's request row at its position, or the padding slot of
    the convention for a token past its lane's extent (a bucket's rows past every lane)."""
    end = (fb.extend_start_loc + fb.extend_seq_lens)[token_to_req]
    owned = torch.arange(fb.input_ids.shape[0], device=end.device) < end
    rows = torch.where(owned, fb.req_pool_indices[token_to_req], worker.pad.row)
    return fb.out_cache_loc.copy_(write_slots(worker.req_pool.req_to_token, rows, fb.positions, worker.req_pool.pad_slot))


def ragged_draft_extend_step(worker: DraftWorker, step: int, fb: ForwardBatch) -> StepOutputs:
    """The ragged body, shared by the eager path and the graph (runners.ragged_draft_extend_cuda_graph_runner): every
    token's logits, one selected row per request through the gather index, the proposal scattered into the next
    step's token ids through the same index (every other row takes the next token's id)."""
    info: EagleDraftInput = fb.spec_info
    ragged_write_slots(worker, fb, token_to_request(fb))
    hidden, lo = draft_layer_logits(worker, step, fb, worker.attn, worker.attn.init_forward_metadata(fb))
    select_index = info.last_token_indices
    logprobs, topk_p, topk_index = selected_top_k(lo, select_index, info.topk)
    shifted = fb.input_ids.roll(-1)
    next_ids = shifted.index_put((select_index,), topk_index[:, 0].to(shifted.dtype))
    return StepOutputs(lo.next_token_logits, hidden, logprobs, topk_p, topk_index, next_ids, lo.rows_fed)


def ragged_forward_batch(worker: DraftWorker, inp: DraftExtendInputs, plan: RaggedPlan, input_ids: torch.Tensor,
                         hidden: torch.Tensor) -> ForwardBatch:
    """The live batch, packed (eager: no padding); input_ids and hidden request-major, as the scheduler hands them."""
    dev = worker.device
    i64 = dict(dtype=torch.int64, device=dev)
    rows, n = plan.index(dev), plan.num_tokens
    accept = torch.tensor(plan.accept_lens, **i64)
    meta = gathered_metadata(worker.ctx.layout, [n], [n], worker.ctx.attn_dp_rank)
    return ForwardBatch(
        forward_mode=ForwardMode.DRAFT_EXTEND_V2,
        batch_size=plan.bs,
        input_ids=input_ids[rows],
        positions=inp.positions[rows],
        seq_lens=inp.seq_lens,  # the verify's, rejected positions included, as vLLM's drafter keeps them: positions mask
        req_pool_indices=inp.req_pool_indices,
        out_cache_loc=torch.empty(n, **i64),  # written by the step body
        extend_seq_lens=accept,
        extend_start_loc=torch.tensor(plan.starts, **i64),
        spec_info=EagleDraftInput(hidden[rows], accept - 1, accept, worker.spec.topk, torch.tensor(plan.last_token_indices, **i64)),
        extend_seq_lens_cpu=list(plan.accept_lens),
        extend_num_tokens=n,
        num_token_non_padded=n,
        seq_lens_sum=int(host_copy(inp.seq_lens_cpu, inp.seq_lens).sum()),
        **meta.forward_batch_fields(dev),
    )


def run_eager_ragged(worker: DraftWorker, inp: DraftExtendInputs,
                     plan: Optional[RaggedPlan] = None) -> tuple[list[StepOutputs], list[ForwardBatch]]:
    """The reference: every draft layer in turn over the packed live batch; outputs request-major (`unpacked`)."""
    worker.spec.check_layout(worker.ctx.layout)
    plan = plan or RaggedPlan.of(inp, worker.tokens_per_bs)
    ids, hidden = inp.input_ids, inp.hidden_states
    outs, batches = [], []
    for step in range(worker.num_layers):
        fb = ragged_forward_batch(worker, inp, plan, ids, hidden)
        out = unpacked(ragged_draft_extend_step(worker, step, fb), plan, worker.device)
        outs.append(out)
        batches.append(fb)
        ids, hidden = out.next_input_ids, out.hidden
    return outs, batches
