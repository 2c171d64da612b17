"""Mutants of logprobs through speculative decoding (runners.logprobs): the flag the draft passes must reset, the rows
the accepted tokens' logprobs are read from. The logprob case's probe kills them (P3, P5, P6)."""
from __future__ import annotations

import torch

from harness.mutants.base import Mutant
from runners import draft_decode, logprobs, spec_decode
from runners.logprobs import SpecLogprobs, compute_spec_logprobs, get_top_logprobs
from runners.spec_decode import SpecEngine


def _keeps_logprob(inp):
    return inp  # the verify's batch handed to the draft-extend as it is: return_logprob still set


def _add_values_row_per_request(reqs, num_committed, lp: SpecLogprobs) -> None:
    """runners.logprobs.add_logprob_return_values with token j of request i read from row i: rows counted per request."""
    token, val, idx = lp.token_logprobs.tolist(), lp.top_val.tolist(), lp.top_idx.tolist()
    for i, (req, n) in enumerate(zip(reqs, num_committed, strict=True)):
        if not req.return_logprob:
            continue
        for j in range(n):
            req.output_token_logprobs.append(token[i][j])
            if req.top_logprobs_num > 0:
                req.output_top_logprobs_val.append(val[i][: req.top_logprobs_num])
                req.output_top_logprobs_idx.append(idx[i][: req.top_logprobs_num])


def _add_logprobs_top_k_from_draft(self: SpecEngine, batch, out, lane_start, accs, takes, params) -> None:
    """SpecEngine._add_logprobs with the top-k read from the draft's logits: the draft-extend that just ran over the
    same lanes (its first step's rows), where the request was in it; the accepted tokens' own logprobs stay the target's."""
    A = min(self.S, self.T - 1) + 1
    index = [[lane_start[i] + node for node in acc.path] + [-1] * (A - len(acc.path)) for i, acc in enumerate(accs)]
    tokens = [acc.new_tokens + [-1] * (A - len(acc.new_tokens)) for acc in accs]
    dev = out.logits.device
    lp = compute_spec_logprobs(out.logits, torch.tensor(index, device=dev), torch.tensor(tokens, device=dev), params)
    logits = out.logits.clone()
    draft = self.draft.last_outs[0].logits if self.draft.last_outs else None
    live = [r for r in batch if r.status == "running"]  # the requests the draft-extend ran, in its lane order
    if draft is not None and draft.shape[0] == len(live) * self.T:
        for li, r in enumerate(live):
            i = batch.index(r)
            logits[lane_start[i] : lane_start[i] + self.T] = draft[li * self.T : (li + 1) * self.T]
    rows = torch.log_softmax(logits[torch.tensor(index, device=dev).clamp(min=0).reshape(-1)].float(), dim=-1)
    top_val, top_idx = get_top_logprobs(rows, [n for n in params.top_logprobs_nums for _ in range(A)])
    logprobs.add_logprob_return_values(batch, takes, SpecLogprobs(lp.token_logprobs, top_val, top_idx))


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "logprob-flag-not-reset-for-draft",
        "the draft-extend runs with the verify batch's return_logprob still set: no draft graph (captured with it off) can "
        "serve the batch, so every draft pass of a batch that asked for logprobs falls back to eager",
        "flag not reset between passes",
        ((draft_decode, "without_logprob", _keeps_logprob),),
        ("logprob-case",),  # P3: the graph run's draft passes replayed every batch
    ),
    Mutant(
        "logprob-top-rows-per-request",
        "the host reads the top-k of request i's accepted token j from row i instead of i * max_accept + j: logprob rows "
        "counted per request in a verify that accepts several tokens per request",
        "logprob rows counted per request",
        ((spec_decode, "add_logprob_return_values", _add_values_row_per_request),),
        ("logprob-case",),  # P5 (the oracle's top-k), P6 (the logprob golden)
    ),
    Mutant(
        "logprob-top-k-from-draft-logits",
        "the top-k logprobs are read from the draft-extend's logits over the same lanes instead of the target's verify "
        "logits (the accepted tokens' own logprobs stay the target's)",
        "top-k logprobs from the draft's logits",
        ((SpecEngine, "_add_logprobs", _add_logprobs_top_k_from_draft),),
        ("logprob-case",),  # P5 (the oracle's top-k), P6 (the logprob golden)
    ),
)
