"""Mutants of the graph runners' replay fill, one per line: each skips one buffer's copy-in or padded-lane fill.

Issue 20 item 8: every replay-fill line of every runner shown necessary. The lines other families already break
(positions and request rows of the multi-layer reset, the verify and decode fills, the host mirrors: verify_fill,
decode, memory, spec_loop, host_mirror) are not repeated here. Each mutant runs the one small probe that sees it:
P1 on one DP layout (lengths, host mirrors, tree masks, gathered counts), P3 on the TP1 case (the multi-layer
draft-extend's live inputs), P8 on the single-layer churn (the live inputs of the other three runners) or P2's
canonical fill on one shrinking case (padded lanes whose stale values no output shows: see the fills' comments).
Lines no property can see are commented at the fill instead (num_accept_tokens, the draft decode's padded top-k
probabilities and hidden states, the single-layer reset's padded num_correct_drafts).
"""
from __future__ import annotations

from harness.mutants.base import Mutant, keeps
from runners.cuda_graph import EagleDraftExtendCudaGraphRunnerBase, MultiLayerEagleMultiStepDraftExtendCudaGraphRunner
from runners.draft_extend import DraftExtendInputs, StepOutputs, with_step_inputs
from runners.eagle_draft_extend_graph import EagleDraftExtendCudaGraphRunner
from runners.eagle_draft_graph import EAGLEDraftCudaGraphRunner
from runners.verify_graph import TargetVerifyCudaGraphRunner

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


def _skips(mutant_id: str, description: str, kind: str, runner: type, method: str, buffer: str, probe: str) -> Mutant:
    """`runner.method` with its write to `buffer` undone (harness.mutants.base.keeps)."""
    return Mutant(mutant_id, description, kind, ((runner, method, keeps(getattr(runner, method), buffer)),), (probe,))


_ML, _SL, _DD, _TV = EagleDraftExtendCudaGraphRunnerBase, EagleDraftExtendCudaGraphRunner, EAGLEDraftCudaGraphRunner, TargetVerifyCudaGraphRunner

MUTANTS: tuple[Mutant, ...] = (
    # ---- the multi-layer draft-extend runner (runners.cuda_graph) ----
    _skips("draft-extend-input-ids-not-copied", "the multi-layer replay copy-in skips input_ids: the graph embeds the last batch's tokens",
           LIVE, _ML, "_copy_live_inputs", "input_ids", "case-tp1"),  # P3
    _skips("draft-extend-hidden-not-copied", "the multi-layer replay copy-in skips hidden_states: the draft reads the last batch's target hidden states",
           LIVE, _ML, "_copy_live_inputs", "hidden_states", "case-tp1"),  # P3
    _skips("draft-extend-seq-lens-not-copied", "the multi-layer replay copy-in skips seq_lens: the live lanes keep the reset's fill length",
           LIVE, _ML, "_copy_live_inputs", "seq_lens", "metadata-dp"),  # P1 (seq_lens_sum); P3
    _skips("draft-extend-req-rows-not-copied", "the multi-layer replay copy-in skips req_pool_indices: every live lane reads and writes KV through the padding row",
           LIVE, _ML, "_copy_live_inputs", "req_pool_indices", "case-tp1"),  # P3
    _skips("draft-extend-correct-drafts-not-copied", "the multi-layer reset skips the live num_correct_drafts: each lane selects the last batch's accepted token",
           LIVE, _ML, "reset_for_iteration", "num_correct_drafts", "case-tp1"),  # P3
    _skips("draft-extend-gathered-fill-skipped", "the multi-layer replay fill leaves global_num_tokens_gpu as the last bucket (or the capture) wrote it",
           GATHERED, _ML, "_fill_for_replay", "global_num_tokens_gpu", "metadata-dp"),  # P1 (fill)
    _skips("draft-extend-logprob-fill-skipped", "the multi-layer replay fill leaves global_num_tokens_for_logprob_gpu as the last bucket (or the capture) wrote it",
           GATHERED, _ML, "_fill_for_replay", "global_num_tokens_for_logprob_gpu", "metadata-dp"),  # P1 (fill)
    _skips("draft-extend-padded-input-ids-stale", "the multi-layer reset leaves input_ids alone: padded lanes keep a larger batch's tokens",
           STALE, _ML, "reset_for_iteration", "input_ids", "padded-lanes-multi-layer"),  # P2 (canonical fill)
    _skips("draft-extend-padded-out-cache-loc-stale", "the multi-layer reset leaves out_cache_loc alone: rows past the live batch keep a larger batch's KV slots",
           STALE, _ML, "reset_for_iteration", "out_cache_loc", "padded-lanes-multi-layer"),  # P2 (canonical fill)
    Mutant("draft-extend-step-ids-not-copied", "steps after the first replay over step 0's token ids: the previous step's tokens are not copied in",
           LIVE, ((MultiLayerEagleMultiStepDraftExtendCudaGraphRunner, "replay", _step_keeps_input_ids),), ("case-tp1",)),  # P3, P4
    Mutant("draft-extend-step-hidden-not-copied", "steps after the first replay over the target's hidden states: the previous step's are not copied in",
           LIVE, ((MultiLayerEagleMultiStepDraftExtendCudaGraphRunner, "replay", _step_keeps_hidden),), ("case-tp1",)),  # P3, P4
    # ---- the single-layer draft-extend runner (runners.eagle_draft_extend_graph) ----
    *(_skips(f"single-layer-{name.replace('_', '-')}-not-copied", f"the single-layer replay fill skips the live {name}", LIVE, _SL, "_fill_for_replay", name,
             "churn-single-layer")  # P8
      for name in ("input_ids", "positions", "req_pool_indices", "num_correct_drafts", "hidden_states")),
    _skips("single-layer-seq-lens-not-copied", "the single-layer replay fill skips the live seq_lens", LIVE, _SL, "_fill_for_replay", "seq_lens",
           "metadata-dp"),  # P1 (seq_lens_sum)
    _skips("single-layer-gathered-fill-skipped", "the single-layer replay fill leaves global_num_tokens_gpu as the last bucket (or the capture) wrote it",
           GATHERED, _SL, "_fill_gathered", "global_num_tokens_gpu", "metadata-dp"),  # P1 (fill)
    _skips("single-layer-padded-seq-lens-stale", "the single-layer reset leaves seq_lens alone: padded lanes keep a larger batch's lengths",
           STALE, _SL, "reset_for_iteration", "seq_lens", "metadata-dp"),  # P1 (padded seq_lens)
    _skips("single-layer-host-seq-lens-stale-padded", "the single-layer reset fills seq_lens of the padded lanes on the device but not in the host mirror",
           STALE, _SL, "reset_for_iteration", "seq_lens_cpu", "metadata-dp"),  # P1 (host mirror)
    _skips("single-layer-padded-req-rows-stale", "the single-layer reset leaves req_pool_indices alone: padded lanes write KV through a larger batch's request rows",
           STALE, _SL, "reset_for_iteration", "req_pool_indices", "churn-single-layer"),  # P8: a live request's KV overwritten
    *(_skips(f"single-layer-padded-{name.replace('_', '-')}-stale", f"the single-layer reset leaves {name} alone: padded lanes keep a larger batch's",
             STALE, _SL, "reset_for_iteration", name, "padded-lanes-single-layer")  # P2 (canonical fill)
      for name in ("input_ids", "positions", "out_cache_loc")),
    # ---- the draft-decode runner (runners.eagle_draft_graph) ----
    *(_skips(f"decode-{name.replace('_', '-')}-not-copied", f"the draft-decode replay copy-in skips the live {name}", LIVE, _DD, "_copy_live_inputs", name,
             "churn-single-layer")  # P8 (topk_index: the loop fails on a token no lane proposed)
      for name in ("topk_p", "topk_index", "hidden_states", "req_pool_indices", "positions")),
    _skips("decode-seq-lens-not-copied", "the draft-decode replay copy-in skips the live seq_lens", LIVE, _DD, "_copy_live_inputs", "seq_lens",
           "metadata-dp"),  # P1 (seq_lens_sum)
    _skips("decode-gathered-fill-skipped", "the draft-decode replay fill leaves global_num_tokens_gpu as the last bucket (or the capture) wrote it",
           GATHERED, _DD, "_fill_for_replay", "global_num_tokens_gpu", "metadata-dp"),  # P1 (fill)
    _skips("decode-logprob-fill-skipped", "the draft-decode replay fill leaves global_num_tokens_for_logprob_gpu as the last bucket (or the capture) wrote it",
           GATHERED, _DD, "_fill_for_replay", "global_num_tokens_for_logprob_gpu", "metadata-dp"),  # P1 (fill)
    # ---- the TARGET_VERIFY runner (runners.verify_graph) ----
    *(_skips(f"verify-{name.replace('_', '-')}-not-copied", f"the TARGET_VERIFY replay copy-in skips the live {name}", LIVE, _TV, "_copy_live_inputs", name,
             "churn-single-layer")  # P8
      for name in ("input_ids", "positions", "req_pool_indices")),
    *(_skips(f"verify-{name.replace('_', '-')}-not-copied", f"the TARGET_VERIFY replay copy-in skips the live {name}", LIVE, _TV, "_copy_live_inputs", name,
             "metadata-dp")  # P1 (seq_lens_sum; a mask copied to one of device and host mirror only)
      for name in ("seq_lens", "custom_mask", "custom_mask_cpu")),
    *(_skips(f"verify-padded-{name.replace('_', '-')}-stale", f"the TARGET_VERIFY replay fill leaves {name} of the padded lanes as a larger batch wrote it",
             STALE, _TV, "_fill_padded_lanes", name, "padded-lanes-single-layer")  # P2 (canonical fill)
      for name in ("input_ids", "positions", "out_cache_loc")),
    *(_skips(f"verify-{name.replace('_', '-')}-fill-skipped", f"the TARGET_VERIFY replay fill leaves {name} as the last bucket (or the capture) wrote it",
             GATHERED, _TV, "_fill_gathered", name, "metadata-dp")  # P1 (fill)
      for name in ("global_num_tokens_gpu", "global_num_tokens_for_logprob_gpu")),
)
