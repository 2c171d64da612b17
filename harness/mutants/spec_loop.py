"""Mutants of the speculative decoding loop (runners.spec_decode): P2 / P5 / P6 / P8 kill these."""
from __future__ import annotations

import torch

from harness.mutants.base import Mutant, keeps
from harness.mutants.draft_extend import REAL_COPY, REAL_RESET

# ---- issue 8: the speculative decoding loop (runners.spec_decode); P2 / P5 / P6 / P8 kill these ----
from runners import draft_decode, verify
from runners.attention.torch_ref import TorchAttnBackend
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import MultiLayerEagleDraftExtendCudaGraphRunner


def _accept_per_request(parents, tokens, argmax) -> list[int]:
    return list(range(len(tokens) if list(tokens[1:2]) == [argmax[0]] else 1))  # the first verdict applied to all its tokens


def _copy_advances_padded_seq_lens(self: MultiLayerEagleDraftExtendCudaGraphRunner, inp) -> None:
    REAL_COPY(self, inp)
    self.seq_lens[inp.bs :] += self.T  # padded rows advanced as if they had extended T tokens too


def _eagle_pairs_next_step_hidden(tokens_after: torch.Tensor, hidden: torch.Tensor):
    return tokens_after, torch.cat([hidden[1:], hidden[-1:]])  # row j: the hidden state of position j + 1


def _copy_pads_with_last_live_slot(self: MultiLayerEagleDraftExtendCudaGraphRunner, inp) -> None:
    REAL_COPY(self, inp)
    if inp.bs:  # the step body looks write slots up through the request row: pad rows with the last live one
        self.req_pool_indices[inp.bs :] = inp.req_pool_indices[-1]


def _reset_marks_padded_lanes_unaccepted(self: MultiLayerEagleDraftExtendCudaGraphRunner, raw_bs: int, accept_lens: torch.Tensor) -> None:
    REAL_RESET(self, raw_bs, accept_lens)
    self.num_accept_tokens[raw_bs:].fill_(0)  # padded lanes "accepted nothing" ...
    self.num_correct_drafts[raw_bs:].fill_(-1)  # ... so their select index, lane * T - 1, is the previous lane's last token


def _attn_reads_masked_kv(vals: torch.Tensor, meta) -> torch.Tensor:
    """The reference attention before masked values were zeroed: a probability-0 key still multiplies its value."""
    return vals


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "stale-padded-tokens-after-shrink",
        "replay reset leaves input_ids, positions and out_cache_loc alone: after the batch shrinks, padded lanes replay the larger batch's tokens and write their KV into its slots",
        "stale padded lane after shrink",
        ((MultiLayerEagleDraftExtendCudaGraphRunner, "reset_for_iteration", keeps(REAL_RESET, "input_ids", "positions", "out_cache_loc")),),
        ("padded-lanes-multi-layer", "padded-lanes", "batch-churn"),  # P2, P8; harmless to outputs here unless poisoned or churned
    ),
    Mutant(
        "accept-per-request",
        "greedy verify decides acceptance once per request (its first draft token) and applies it to all its tokens, instead of token by token along the chain",
        "acceptance per request instead of per token",
        ((verify, "accept_path", _accept_per_request),),
        ("batch-churn:tp1", "batch-churn", "spec-cases"),  # P8, P5/P6: verify runs only in the speculative-loop probes
    ),
    Mutant(
        "seq-len-advanced-for-padded-rows",
        "replay copy-in advances the seq_lens of the padded lanes by num_tokens_per_bs, as if padded rows had extended too (they should stay at the fill value)",
        "seq_len advanced for padded rows",
        ((MultiLayerEagleDraftExtendCudaGraphRunner, "_copy_live_inputs", _copy_advances_padded_seq_lens),),
        ("metadata-dp", "metadata-grid", "padded-lanes", "cases"),  # P1 (grid, cases), P2
    ),
    Mutant(
        "draft-hidden-next-step",
        "EAGLE pairing off by one step: draft row j reads token j+1 with the target hidden state of position j+1 instead of j (prefill and draft-extend)",
        "hidden state from the wrong step",
        ((draft_decode, "eagle_pairs", _eagle_pairs_next_step_hidden),),
        ("spec-cases:tp2_dp2_mlp_tp_gather-eager", "spec-cases"),  # P6 only: the EAGLE pairing of the loop
    ),
    Mutant(
        "padded-kv-write-live-slot",
        "replay pads req_pool_indices by repeating the last live request row: the step body looks the padded rows' KV write slots up through it, so they land in that request's slots",
        "KV write for padded rows lands in a live slot",
        ((MultiLayerEagleDraftExtendCudaGraphRunner, "_copy_live_inputs", _copy_pads_with_last_live_slot),),
        ("padded-lanes-multi-layer", "padded-lanes", "batch-churn", "cases"),  # P2, P8, P3/P4
    ),
    Mutant(
        "attn-reads-masked-kv",
        "reference attention multiplies masked (probability 0) KV entries instead of excluding them: a NaN in the padding slot or a stale slot reaches every real row",
        "padded / stale memory read into a real row",
        ((TorchAttnBackend, "masked_values", staticmethod(_attn_reads_masked_kv)),),
        ("padded-lanes-single-layer", "padded-lanes"),  # P2 only: masked KV is finite here unless poisoned
    ),
    Mutant(
        "padded-accept-len-zero",
        "replay reset gives padded lanes accept length 0 (num_correct_drafts -1) instead of keeping an in-range value: a padded lane's select index is the last token of the lane before it, so the first padded lane overwrites the last real lane's next input id",
        "padded lane writes into a real lane",
        ((MultiLayerEagleDraftExtendCudaGraphRunner, "reset_for_iteration", _reset_marks_padded_lanes_unaccepted),),
        ("padded-lanes:tp2_page4_tree", "padded-lanes", "batch-churn", "cases"),  # P2, P8, P3/P4
    ),
    Mutant(
        "loop-draft-extend-never-replays",
        "the multi-layer draft-extend runner refuses every batch (can_run false, as a bucket list that fits nothing): the "
        "loop's graph run drafts eagerly, and a comparison of it with the eager run compares eager with eager",
        "graph silently not used",
        ((MultiLayerEagleDraftExtendCudaGraphRunner, "can_run", lambda self, inp: False),),
        ("spec-cases:tp1_neither", "spec-cases"),  # P3 (replayed: graph replays > 0), the loop's check that its graph run ran its graphs
    ),
)
