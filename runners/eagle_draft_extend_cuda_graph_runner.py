"""EAGLEDraftExtendCudaGraphRunner: the single-layer EAGLE draft-extend CUDA-graph runner (step 0 only): its own
buffers, its own get_forward_batch and replay fill (the buffer layout, body and replay it shares with the multi-layer
runner are runners.draft_extend_cuda_graph_runner's).

It is written apart from the multi-layer runner (runners.multi_layer_eagle_draft_extend_cuda_graph_runner) on purpose:
invariant I6 (the two runners agree on the metadata of the same batches) then compares two codes, as in the engine,
where the two runners live in separate files and a fix to one has missed the other (sglang#26416). Its padded-lane
reset differs from the multi-layer one where the engine's does: it runs only when the bucket is padded. A padded lane
selects its own last token (num_correct_drafts = T - 1), because this body selects rows in the graph.
"""
from __future__ import annotations

import torch

from runners.base_cuda_graph_runner import RunnerKind
from runners.batch import EagleDraftInput, ForwardBatch, ForwardMode, host_copy
from runners.draft_extend import SEQ_LEN_FILL_VALUE, DraftExtendInputs, DraftWorker, StepOutputs
from runners.draft_extend_cuda_graph_runner import DraftExtendCudaGraphRunner
from runners.graph.backend import GraphBackend
from runners.replay_copy import grouped_foreach_copy_


class EAGLEDraftExtendCudaGraphRunner(DraftExtendCudaGraphRunner):
    """The single-layer EAGLE draft-extend runner: one graph per bucket over its own buffers."""

    runner_kind = RunnerKind.SINGLE_LAYER

    def __init__(self, worker: DraftWorker, backend: GraphBackend):
        super().__init__(worker, 0, backend)

    def get_forward_batch(self, bs: int) -> ForwardBatch:
        buffers, layout = self.buffers, self.layout
        num_tokens = bs * self.T
        num_tokens_for_logprob = num_tokens  # DRAFT_EXTEND_V2: lm_head sees every token of the bucket
        if layout.require_mlp_tp_gather:
            global_num_tokens_cpu = [num_tokens] * layout.attn_dp_size
        elif layout.require_attn_tp_gather:
            global_num_tokens_cpu = [num_tokens]
        else:
            global_num_tokens_cpu = None
        if global_num_tokens_cpu is None:
            global_num_tokens_for_logprob_cpu = global_dp_buffer_len = None
        else:
            global_num_tokens_for_logprob_cpu = [num_tokens_for_logprob] * len(global_num_tokens_cpu)
            global_dp_buffer_len = sum(global_num_tokens_cpu)
            buffers.global_num_tokens_gpu.copy_(torch.tensor(global_num_tokens_cpu, dtype=torch.int32))
            buffers.global_num_tokens_for_logprob_gpu.copy_(torch.tensor(global_num_tokens_for_logprob_cpu, dtype=torch.int32))
        spec_info = EagleDraftInput(
            hidden_states=buffers.hidden_states[:num_tokens],
            num_correct_drafts=buffers.num_correct_drafts[:bs],
            num_accept_tokens=buffers.num_accept_tokens[:bs],
            topk=self.worker.spec.topk,
        )
        fb = ForwardBatch(
            forward_mode=ForwardMode.DRAFT_EXTEND_V2,
            batch_size=bs,
            input_ids=buffers.input_ids[:num_tokens],
            positions=buffers.positions[:num_tokens],
            seq_lens=buffers.seq_lens[:bs],
            seq_lens_cpu=buffers.seq_lens_cpu[:bs],
            req_pool_indices=buffers.req_pool_indices[:bs],
            out_cache_loc=buffers.out_cache_loc[:num_tokens],
            extend_seq_lens=buffers.extend_seq_lens[:bs],
            extend_start_loc=buffers.extend_start_loc[:bs],
            spec_info=spec_info,
            extend_seq_lens_cpu=[self.T] * bs,
            extend_num_tokens=num_tokens,
            num_token_non_padded=num_tokens,
            seq_lens_sum=bs * SEQ_LEN_FILL_VALUE,
            global_num_tokens_cpu=global_num_tokens_cpu,
            global_num_tokens_gpu=buffers.global_num_tokens_gpu,
            global_num_tokens_for_logprob_cpu=global_num_tokens_for_logprob_cpu,
            global_num_tokens_for_logprob_gpu=buffers.global_num_tokens_for_logprob_gpu,
            global_dp_buffer_len=global_dp_buffer_len,
        )
        return fb

    # ---- the replay fill ----
    def _fill_padded_lanes(self, num_tokens: int, bs: int) -> None:
        """Every lane to the padding state when the bucket holds more tokens than the batch, before the
        live lanes are copied over it; with no padding the graph reads live lanes only, and nothing is reset.

        Request row 0 and position 0 make a padded lane's in-graph KV slot lookup land in the
        padding slot; accept lengths of T make it select its own last token.
        """
        if bs * self.T == num_tokens:  # as the engine: padding is judged in tokens, the bucket's against the batch's
            return
        buffers = self.buffers
        buffers.reset_to_padding(self.worker.pad)
        # the lane's own last row: this body selects in the graph by num_correct_drafts (a stale 0..T-1 selects in its own
        # lane too: no output differs); the engine's worker selects outside the graph, and its fill value (T) is no row there
        buffers.num_correct_drafts.fill_(self.T - 1)
        buffers.num_accept_tokens.fill_(self.T)  # unread here, as the live copy below

    def _fill_for_replay(self, inp: DraftExtendInputs) -> int:
        """Padded lanes, live lanes in, gathered counts written; returns the bucket. No device sync when inp carries its host lengths."""
        raw_bs, buffers = inp.bs, self.buffers
        bs = self._choose_bucket(self._needed_bs(inp))
        num_tokens = int(inp.input_ids.shape[0])
        self._fill_padded_lanes(num_tokens, bs)
        grouped_foreach_copy_(
            [buffers.input_ids[:num_tokens], buffers.positions[:num_tokens], buffers.seq_lens[:raw_bs],
             buffers.req_pool_indices[:raw_bs], buffers.num_correct_drafts[:raw_bs],
             buffers.num_accept_tokens[:raw_bs]],  # unread here (the body selects by num_correct_drafts); the engine's backends read it
            [inp.input_ids, inp.positions, inp.seq_lens, inp.req_pool_indices, inp.accept_lens - 1, inp.accept_lens],
        )
        buffers.hidden_states[:num_tokens].copy_(inp.hidden_states)  # a plain copy: large and contiguous
        buffers.seq_lens_cpu[:raw_bs].copy_(host_copy(inp.seq_lens_cpu, inp.seq_lens))
        self._fill_gathered(bs)
        return bs

    def _fill_gathered(self, bs: int) -> None:
        if self.buffers.global_num_tokens_gpu is not None:
            self.buffers.global_num_tokens_gpu.fill_(bs * self.T)
            self.buffers.global_num_tokens_for_logprob_gpu.fill_(bs * self.T)

    def replay(self, inp: DraftExtendInputs) -> StepOutputs:
        return self._replay_filled(inp, self._fill_for_replay(inp))
