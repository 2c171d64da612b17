"""Output logprobs through speculative decoding: each committed token's target logprob and top-k logprobs.

A request asks for logprobs (return_logprob) and for the top_logprobs_num most likely tokens at each output position,
as SGLang's sampling params do. A batch returns logprobs when any of its requests asks (ScheduleBatch.return_logprob,
with top_logprobs_nums, one per request). Through the speculative loop:

- the flag rides into the target's passes: the prefill that samples a request's first token and the verify that
  accepts the rest;
- every draft pass runs with it reset (SGLang's eagle_worker_v2 resets forward_batch.return_logprob for the draft,
  and its draft graph runners capture with it off). A graph captured with the flag off has no logprob tail, so a batch
  that carries the flag cannot replay a draft graph (DraftExtendCudaGraphRunner.can_run), as SGLang's prefill graph
  runner refuses one without an eager logits tail: a draft pass that forgets the reset runs eagerly;
- the target's verify graph serves logprob batches all the same: the logprobs are read after it from the verify's
  logits, which hold a row for every token (compute_spec_logprobs, SGLang's layers/logprob_processor.py): the accepted
  rows (accept_index), their log_softmax, the accepted token's entry, and each row's top-k, k its request's
  top_logprobs_num repeated once per accepted row;
- the host appends them per request, token j of request i from row i * max_accept + j (SGLang's
  batch_result_processor._apply_decode_logprobs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from runners.outputs import RunnerOutputs


class LogprobRequest(Protocol):
    return_logprob: bool
    top_logprobs_num: int
    output_token_logprobs: list[float]
    output_top_logprobs_idx: list[list[int]]
    output_top_logprobs_val: list[list[float]]


@dataclass(frozen=True)
class LogprobParams:
    """A batch's logprob flag and its requests' top-k counts (ScheduleBatch.return_logprob, top_logprobs_nums)."""

    return_logprob: bool = False
    top_logprobs_nums: tuple[int, ...] = ()

    @classmethod
    def of(cls, reqs: Sequence[LogprobRequest]) -> "LogprobParams":
        if not any(r.return_logprob for r in reqs):
            return NO_LOGPROBS
        return cls(True, tuple(r.top_logprobs_num if r.return_logprob else 0 for r in reqs))


NO_LOGPROBS = LogprobParams()


@dataclass
class SpecLogprobs(RunnerOutputs):
    """The accepted rows' logprobs: token_logprobs [bs, max_accept]; top_val / top_idx [bs * max_accept, K], a row's
    entries past its k are -inf / -1 (K = the batch's largest top_logprobs_num, 0 when none asks)."""

    token_logprobs: torch.Tensor
    top_val: torch.Tensor
    top_idx: torch.Tensor

    @property
    def max_accept(self) -> int:
        return int(self.token_logprobs.shape[1])


def get_top_logprobs(logprobs: torch.Tensor, nums_per_row: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top nums_per_row[i] (values, token ids), padded to the largest with -inf / -1."""
    k = max(nums_per_row, default=0)
    if k == 0:
        empty = logprobs.new_zeros(logprobs.shape[0], 0)
        return empty, empty.to(torch.int64)
    val, idx = logprobs.topk(k, dim=-1)
    keep = torch.arange(k, device=logprobs.device)[None, :] < torch.tensor(list(nums_per_row), device=logprobs.device)[:, None]
    return val.masked_fill(~keep, float("-inf")), idx.masked_fill(~keep, -1)


def compute_spec_logprobs(logits: torch.Tensor, accept_index: torch.Tensor, accepted_ids: torch.Tensor,
                          params: LogprobParams) -> SpecLogprobs:
    """accept_index [bs, A]: the logits row of each accepted token (-1 past a request's accept length: its row is
    read, never appended); accepted_ids [bs, A] the tokens. A = max_accept: the verify's chain depth + the bonus."""
    bs, A = accept_index.shape
    rows = logits[accept_index.clamp(min=0).reshape(-1)].float()
    logprobs = torch.log_softmax(rows, dim=-1).clamp_(min=torch.finfo(torch.float32).min)
    token = logprobs.gather(1, accepted_ids.clamp(min=0).reshape(-1, 1).to(torch.int64)).view(bs, A)
    top_val, top_idx = get_top_logprobs(logprobs, [n for n in params.top_logprobs_nums for _ in range(A)])
    return SpecLogprobs(token, top_val, top_idx)


def add_logprob_return_values(reqs: Sequence[LogprobRequest], num_committed: Sequence[int], lp: SpecLogprobs) -> None:
    """Append request i's first num_committed[i] accepted tokens' logprobs (and top-k, if it asked), on the host."""
    token, val, idx = lp.token_logprobs.tolist(), lp.top_val.tolist(), lp.top_idx.tolist()
    for i, (req, n) in enumerate(zip(reqs, num_committed, strict=True)):
        if not req.return_logprob:
            continue
        for j in range(n):
            req.output_token_logprobs.append(token[i][j])
            if req.top_logprobs_num > 0:
                flat = i * lp.max_accept + j
                req.output_top_logprobs_val.append(val[flat][: req.top_logprobs_num])
                req.output_top_logprobs_idx.append(idx[flat][: req.top_logprobs_num])
