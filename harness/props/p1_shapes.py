"""P1 rules of vLLM's shapes of the draft-extend: a PIECEWISE graph's eager attention is built for the live requests; the
ragged runner's last-token gather index is padded (P2 checks it after every replay fill of the loop too)."""
from __future__ import annotations

import torch

from harness.props.p1_records import record_where
from harness.run.records import ReplayRecord
from harness.verdict import Verdict
from runners.base_cuda_graph_runner import RunnerKind
from runners.draft_extend import DraftExtendInputs
from runners.parallel.layout import ParallelLayout

# The runners that are a step of a multi-layer draft-extend (every one counts the same logprob rows as the single-layer
# runner for the same batch: I6).
MULTI_STEP_KINDS = (RunnerKind.MULTI_LAYER, RunnerKind.RAGGED, RunnerKind.PIECEWISE)


def check_live_attention_batch(v: Verdict, layout: ParallelLayout, runner, rec: ReplayRecord, tp_rank: int, iteration: int) -> None:
    """After a PIECEWISE replay fill: the batch the graph break attends with (the runner's live_attention_batch) holds
    the live requests and their tokens, raw_bs and raw_bs * T, never the bucket's; the dense pieces' token count is the
    bucket's, bs * T, a captured size (check_replay_record checks the bucket rules and the baked num_tokens)."""
    w = record_where(layout, rec, tp_rank, iteration)
    fb = runner.live_attention_batch()
    v.expect_equal("padding", "attention batch_size (PIECEWISE)", w, rec.raw_bs, fb.batch_size,
                   "attention metadata is built for the live requests, not the padded bucket")
    v.expect_equal("padding", "attention tokens (PIECEWISE)", w, rec.raw_bs * rec.tokens_per_bs, fb.num_tokens,
                   "attention runs over the live tokens, not the token count padded to the capture size")
    v.expect_equal("padding", "dense token count (PIECEWISE)", w, rec.bs * rec.tokens_per_bs, rec.capture.num_tokens,
                   "the dense pieces run the token count padded to the capture size")


def check_ragged_gather_index(v: Verdict, buffers, inp: DraftExtendInputs, bs: int, T: int, where: dict) -> None:
    """The bucket's lanes of the persistent gather index (vLLM's last_token_indices), from the live accept lengths alone:
    live lane i names its last accepted token, sum of the accept lengths before it plus its own minus one; a padded
    lane names a row no live token holds (at or past their count, inside the bucket's bs * T rows) and no other lane
    names, so its proposal, scattered through the index into the next step's token ids, lands on padding. A stale
    index left by a larger batch names a live request's row instead."""
    accept = inp.accept_lens.tolist()
    live_tokens = sum(accept)
    starts = [sum(accept[:i]) for i in range(len(accept))]
    index = buffers.last_token_indices[:bs].tolist()
    v.checked += 1
    want = [s + a - 1 for s, a in zip(starts, accept, strict=True)]
    if index[: len(accept)] != want:
        lane = next(i for i, (x, y) in enumerate(zip(index[: len(want)], want, strict=True)) if x != y)
        v.fail("canonical", "last_token_indices", {**where, "lane": lane}, want[lane], index[lane], f"live lane {lane}'s last accepted token row")
    padded = torch.tensor(index[len(accept):], dtype=torch.int64)
    v.checked += 1
    bad = ((padded < live_tokens) | (padded >= bs * T)).nonzero()
    if bad.numel():
        lane = len(accept) + int(bad[0, 0])
        v.fail("canonical", "last_token_indices", {**where, "lane": lane}, f"a padding row in [{live_tokens}, {bs * T})", index[lane],
               f"padded lane {lane}'s gather index names a live token's row (stale from a larger batch?)")
    elif len(set(padded.tolist())) != padded.numel():
        v.fail("canonical", "last_token_indices", where, "one padding row per padded lane", padded.tolist(), "two padded lanes share a row")
