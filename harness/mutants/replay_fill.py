"""Mutants of the graph runners' replay fill, one per line: each skips one buffer's copy-in or padded-lane fill.

Issue 20 item 8: every replay-fill line of every runner shown necessary. The lines other families already break
(positions and request rows of the multi-layer reset, the verify and decode fills, the host mirrors: verify_fill,
decode, memory, spec_loop, host_mirror) are not repeated here. Each mutant runs the one small probe that sees it:
P1 on one DP layout (lengths, host mirrors, tree masks, gathered counts), P3 on the TP1 case (the multi-layer
draft-extend's live inputs), P8 on the single-layer churn (the live inputs of the other three runners) or P2's
canonical fill on one shrinking case (padded lanes hold the engine's fill values, whether or not an output would
show a stale one). Lines no property can see are commented at the fill instead (num_accept_tokens, the draft
decode's padded top-k probabilities and hidden states, the single-layer reset's padded num_correct_drafts); the
table line -> mutant -> killer is docs/replay-fill.md.
"""
from __future__ import annotations

from harness.mutants.base import Mutant, keeps
from runners.decode_cuda_graph_runner import DecodeCudaGraphRunner
from runners.draft_extend import DraftExtendInputs, StepOutputs, with_step_inputs
from runners.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
from runners.eagle_draft_extend_cuda_graph_runner import EAGLEDraftExtendCudaGraphRunner
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import (
    MultiLayerEagleDraftExtendCudaGraphRunner,
    MultiLayerEagleMultiStepDraftExtendCudaGraphRunner,
)

LIVE = "live lane not copied in"
STALE = "stale padded lane after shrink"
GATHERED = "gathered count not refilled"

_MULTI_STEP_REPLAY = MultiLayerEagleMultiStepDraftExtendCudaGraphRunner.replay


def _step_keeps_input_ids(self: MultiLayerEagleMultiStepDraftExtendCudaGraphRunner, step: int, inp: DraftExtendInputs) -> StepOutputs:
    if step:  # the copy of the previous step's tokens writes what the buffer already holds: step 0's
        inp = with_step_inputs(inp, self.buffers.input_ids[: inp.bs * self.runners[0].T].clone(), inp.hidden_states)
    return _MULTI_STEP_REPLAY(self, step, inp)


def _step_keeps_hidden(self: MultiLayerEagleMultiStepDraftExtendCudaGraphRunner, step: int, inp: DraftExtendInputs) -> StepOutputs:
    if step:  # likewise the hidden states: every step reads the target's
        inp = with_step_inputs(inp, inp.input_ids, self.buffers.hidden_states[: inp.bs * self.runners[0].T].clone())
    return _MULTI_STEP_REPLAY(self, step, inp)


_ML, _SL, _DD, _TV = MultiLayerEagleDraftExtendCudaGraphRunner, EAGLEDraftExtendCudaGraphRunner, EAGLEDraftCudaGraphRunner, DecodeCudaGraphRunner

# (id, what the skipped write breaks, kind, runner, method, buffer whose write is undone, the probe that kills it: property)
_SKIPPED_WRITES = (
    # ---- the multi-layer draft-extend runner (runners.multi_layer_eagle_draft_extend_cuda_graph_runner) ----
    ("draft-extend-input-ids-not-copied", "the graph embeds the reset's token 0", LIVE, _ML, "_copy_live_inputs", "input_ids", "case-tp1"),  # P3
    ("draft-extend-hidden-not-copied", "the draft reads the last batch's target hidden states", LIVE, _ML, "_copy_live_inputs", "hidden_states", "case-tp1"),  # P3
    ("draft-extend-seq-lens-not-copied", "the live lanes keep the reset's fill length", LIVE, _ML, "_copy_live_inputs", "seq_lens", "metadata-dp"),  # P1 (seq_lens_sum)
    ("draft-extend-req-rows-not-copied", "every live lane reads and writes KV through the padding row", LIVE, _ML, "_copy_live_inputs", "req_pool_indices", "case-tp1"),  # P3
    ("draft-extend-correct-drafts-not-copied", "each lane selects the row of the last iteration's accept length", LIVE, _ML, "reset_for_iteration", "num_correct_drafts", "case-tp1"),  # P3
    ("draft-extend-gathered-fill-skipped", "the DP gather reads the last bucket's token counts", GATHERED, _ML, "_fill_for_replay", "global_num_tokens_gpu", "metadata-dp"),  # P1 (fill)
    ("draft-extend-logprob-fill-skipped", "the logits gather reads the last bucket's row counts", GATHERED, _ML, "_fill_for_replay", "global_num_tokens_for_logprob_gpu", "metadata-dp"),  # P1 (fill)
    ("draft-extend-padded-input-ids-stale", "padded lanes keep a larger batch's tokens", STALE, _ML, "reset_for_iteration", "input_ids", "padded-lanes-multi-layer"),  # P2 (canonical)
    ("draft-extend-padded-out-cache-loc-stale", "rows past the live batch keep a larger batch's KV slots", STALE, _ML, "reset_for_iteration", "out_cache_loc", "padded-lanes-multi-layer"),  # P2 (canonical)
    # ---- the single-layer draft-extend runner (runners.eagle_draft_extend_cuda_graph_runner) ----
    ("single-layer-input-ids-not-copied", "the graph embeds the reset's token 0", LIVE, _SL, "_fill_for_replay", "input_ids", "churn-single-layer"),  # P8
    ("single-layer-positions-not-copied", "every token reads the rotary row of position 0", LIVE, _SL, "_fill_for_replay", "positions", "churn-single-layer"),  # P8
    ("single-layer-req-rows-not-copied", "every live lane reads and writes KV through the padding row", LIVE, _SL, "_fill_for_replay", "req_pool_indices", "churn-single-layer"),  # P8
    ("single-layer-correct-drafts-not-copied", "each lane selects its last token, whatever it accepted", LIVE, _SL, "_fill_for_replay", "num_correct_drafts", "churn-single-layer"),  # P8
    ("single-layer-hidden-not-copied", "the draft reads the last batch's target hidden states", LIVE, _SL, "_fill_for_replay", "hidden_states", "churn-single-layer"),  # P8
    ("single-layer-seq-lens-not-copied", "the live lanes keep the reset's fill length", LIVE, _SL, "_fill_for_replay", "seq_lens", "metadata-dp"),  # P1 (seq_lens_sum)
    ("single-layer-gathered-fill-skipped", "the DP gather reads the last bucket's token counts", GATHERED, _SL, "_fill_gathered", "global_num_tokens_gpu", "metadata-dp"),  # P1 (fill)
    ("single-layer-padded-seq-lens-stale", "padded lanes keep a larger batch's lengths", STALE, _SL, "_fill_padded_lanes", "seq_lens", "metadata-dp"),  # P1 (padded seq_lens)
    ("single-layer-host-seq-lens-stale-padded", "the host mirror keeps a larger batch's lengths in the padded lanes", STALE, _SL, "_fill_padded_lanes", "seq_lens_cpu", "metadata-dp"),  # P1 (host mirror)
    ("single-layer-padded-req-rows-stale", "padded lanes write KV through a larger batch's request rows", STALE, _SL, "_fill_padded_lanes", "req_pool_indices", "churn-single-layer"),  # P8
    ("single-layer-padded-input-ids-stale", "padded lanes keep a larger batch's tokens", STALE, _SL, "_fill_padded_lanes", "input_ids", "padded-lanes-single-layer"),  # P2 (canonical)
    ("single-layer-padded-positions-stale", "padded lanes keep a larger batch's positions", STALE, _SL, "_fill_padded_lanes", "positions", "padded-lanes-single-layer"),  # P2 (canonical)
    ("single-layer-padded-out-cache-loc-stale", "rows past the live batch keep a larger batch's KV slots", STALE, _SL, "_fill_padded_lanes", "out_cache_loc", "padded-lanes-single-layer"),  # P2 (canonical)
    # ---- the draft-decode runner (runners.eagle_draft_cuda_graph_runner) ----
    ("decode-topk-p-not-copied", "the tree is scored with a stale batch's probabilities (zeros when the padded fill ran)", LIVE, _DD, "_copy_live_inputs", "topk_p", "churn-single-layer"),  # P8
    ("decode-topk-index-not-copied", "the tree grows from a stale batch's tokens", LIVE, _DD, "_copy_live_inputs", "topk_index", "churn-single-layer"),  # run: the loop meets a token no lane proposed
    ("decode-hidden-not-copied", "the draft steps read a stale batch's hidden states", LIVE, _DD, "_copy_live_inputs", "hidden_states", "churn-single-layer"),  # P8
    ("decode-req-rows-not-copied", "every lane reads and writes KV through stale request rows (or the padding row)", LIVE, _DD, "_copy_live_inputs", "req_pool_indices", "churn-single-layer"),  # P8
    ("decode-positions-not-copied", "every lane reads the rotary rows of stale positions", LIVE, _DD, "_copy_live_inputs", "positions", "churn-single-layer"),  # P8
    ("decode-seq-lens-not-copied", "the live lanes keep stale lengths (or the fill value)", LIVE, _DD, "_copy_live_inputs", "seq_lens", "metadata-dp"),  # P1 (seq_lens_sum)
    ("decode-gathered-fill-skipped", "the DP gather reads the last bucket's token counts", GATHERED, _DD, "_fill_for_replay", "global_num_tokens_gpu", "metadata-dp"),  # P1 (fill)
    ("decode-logprob-fill-skipped", "the logits gather reads the last bucket's row counts", GATHERED, _DD, "_fill_for_replay", "global_num_tokens_for_logprob_gpu", "metadata-dp"),  # P1 (fill)
    # ---- the TARGET_VERIFY runner (runners.decode_cuda_graph_runner) ----
    ("verify-input-ids-not-copied", "the target verifies the last batch's tokens", LIVE, _TV, "_copy_live_inputs", "input_ids", "churn-single-layer"),  # P8
    ("verify-positions-not-copied", "every node reads the rotary row of the last batch's positions", LIVE, _TV, "_copy_live_inputs", "positions", "churn-single-layer"),  # P8
    ("verify-req-rows-not-copied", "every lane reads and writes KV through the last batch's request rows", LIVE, _TV, "_copy_live_inputs", "req_pool_indices", "churn-single-layer"),  # P8
    ("verify-seq-lens-not-copied", "the live lanes keep the last batch's lengths", LIVE, _TV, "_copy_live_inputs", "seq_lens", "metadata-dp"),  # P1 (seq_lens_sum)
    ("verify-mask-not-copied", "the graph attends with the last batch's tree masks", LIVE, _TV, "_copy_live_inputs", "custom_mask", "metadata-dp"),  # P1 (host mirror vs device)
    ("verify-host-mask-not-copied", "a host-planned backend plans with the last batch's tree masks", LIVE, _TV, "_copy_live_inputs", "custom_mask_cpu", "metadata-dp"),  # P1 (host mirror)
    ("verify-padded-input-ids-stale", "padded lanes keep a larger batch's tokens", STALE, _TV, "_fill_padded_lanes", "input_ids", "padded-lanes-single-layer"),  # P2 (canonical)
    ("verify-padded-positions-stale", "padded lanes keep a larger batch's positions", STALE, _TV, "_fill_padded_lanes", "positions", "padded-lanes-single-layer"),  # P2 (canonical)
    ("verify-gathered-fill-skipped", "the DP gather reads the last bucket's token counts", GATHERED, _TV, "_fill_gathered", "global_num_tokens_gpu", "metadata-dp"),  # P1 (fill)
    ("verify-logprob-fill-skipped", "the logits gather reads the last bucket's row counts", GATHERED, _TV, "_fill_gathered", "global_num_tokens_for_logprob_gpu", "metadata-dp"),  # P1 (fill)
)


def _skips(mutant_id: str, harm: str, kind: str, runner: type, method: str, buffer: str, probe: str) -> Mutant:
    """`runner.method` with its write to `buffer` undone (harness.mutants.base.keeps)."""
    description = f"{runner.__name__}.{method} skips its write to {buffer}: {harm}"
    return Mutant(mutant_id, description, kind, ((runner, method, keeps(getattr(runner, method), buffer)),), (probe,))


MUTANTS: tuple[Mutant, ...] = (
    *(_skips(*row) for row in _SKIPPED_WRITES),
    Mutant("draft-extend-step-ids-not-copied", "steps after the first replay over step 0's token ids: the previous step's tokens are not copied in",
           LIVE, ((MultiLayerEagleMultiStepDraftExtendCudaGraphRunner, "replay", _step_keeps_input_ids),), ("case-tp1",)),  # P3, P4
    Mutant("draft-extend-step-hidden-not-copied", "steps after the first replay over the target's hidden states: the previous step's are not copied in",
           LIVE, ((MultiLayerEagleMultiStepDraftExtendCudaGraphRunner, "replay", _step_keeps_hidden),), ("case-tp1",)),  # P3, P4
)
