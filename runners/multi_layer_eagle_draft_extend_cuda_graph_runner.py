"""One step of the multi-layer EAGLE draft-extend as a CUDA-graph runner: its get_forward_batch and the fill of
the buffers the steps share (DESIGN.md §6.2-6.4). The composites that own the steps are runners.cuda_graph (a graph
per step) and runners.one_graph_draft_extend (one graph per bucket for every step).

Static buffers sized for the largest bucket; one graph per capture_bs bucket; `get_forward_batch(bs)` bakes the
per-branch metadata; the replay fill copies only the live lanes in and writes the gathered gpu tensors; each step
replays and slices the raw rows out. Padded lanes keep their reset or stale values on purpose: that is what the engine
does, and what the harness must prove harmless. The single-layer runner is runners.eagle_draft_extend_graph.

The fill has two paths, as the engine's: on a CUDA worker one fused Triton launch (runners.draft_extend_fill) in
place of the fill's many small torch launches; on any other device the torch methods below, its native twin, which
the CPU suite and the built-in mutants exercise. Both leave the device buffers bitwise alike. The runner picks its
path once, at construction, from the worker's device.
"""
from __future__ import annotations

import importlib
from typing import Callable, Optional

import torch

from runners.batch import EagleDraftInput, ForwardBatch, ForwardMode, host_copy
from runners.dp_metadata import GatheredMetadata
from runners.draft_extend import SEQ_LEN_FILL_VALUE, DraftExtendInputs, DraftWorker, StepOutputs
from runners.draft_extend_buffers import DraftExtendGraphRunner, DraftExtendInputBuffers, PrepareFill
from runners.graph_backend import GraphBackend
from runners.graph_runner import RunnerKind
from runners.memory import PADDING_ROW, PADDING_SLOT


def _fused_fill() -> Callable[[DraftExtendInputBuffers, DraftExtendInputs, int, int], None]:
    """The fused fill's launcher, imported on the fused path only: its module imports triton, an optional package
    (runners.attention imports its backends the same way), and a CPU process must not pay for it or have it set
    TRITON_INTERPRET."""
    return importlib.import_module("runners.draft_extend_fill").fill_prepare_buffers


class EagleDraftExtendCudaGraphRunnerBase(DraftExtendGraphRunner):
    """One step of the multi-layer draft: its get_forward_batch and the fill of the (shared) buffers.

    A runner made alone (buffers=None) owns its buffers and fills them itself through
    prepare_replay; inside MultiLayerEagleMultiStepDraftExtendCudaGraphRunner the first
    step's runner fills the shared set once per iteration and every step replays over it.
    `prepare_fill` says how the fill is written (runners.draft_extend_fill); a test may pin it.
    """

    def __init__(self, worker: DraftWorker, step: int, backend: GraphBackend, buffers: Optional[DraftExtendInputBuffers] = None):
        super().__init__(worker, step, backend, buffers)
        self.prepare_fill = PrepareFill.for_device(worker.device)

    # ---- metadata, per branch (§6.3) ----
    def get_forward_batch(self, bs: int) -> ForwardBatch:
        num_tokens = bs * self.T
        if self.layout.require_mlp_tp_gather:
            global_num_tokens_cpu = [num_tokens] * self.layout.attn_dp_size
            global_num_tokens_for_logprob_cpu = [num_tokens] * self.layout.attn_dp_size
        elif self.layout.require_attn_tp_gather:
            global_num_tokens_cpu = [num_tokens]
            # DRAFT_EXTEND_V2 emits logits for every token, so the logprob count is tokens, not bs
            global_num_tokens_for_logprob_cpu = [num_tokens]
        else:
            global_num_tokens_cpu = global_num_tokens_for_logprob_cpu = None
        global_dp_buffer_len = None if global_num_tokens_cpu is None else sum(global_num_tokens_cpu)
        self._bake_gathered(GatheredMetadata(global_num_tokens_cpu, global_num_tokens_for_logprob_cpu, global_dp_buffer_len))
        buffers = self.buffers
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
            spec_info=EagleDraftInput(buffers.hidden_states[:num_tokens], buffers.num_correct_drafts[:bs],
                                      buffers.num_accept_tokens[:bs], self.worker.spec.topk),
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

    # ---- the replay fill (§6.4) ----
    def reset_for_iteration(self, raw_bs: int, accept_lens: torch.Tensor) -> None:
        """Once per decode iteration, before the first step: reset token buffers, seq lens and request rows.

        The step body looks each token's KV write location up as
        req_to_token[req_pool_indices[lane], position] and gathers its rotary row by position,
        so a padded lane must hold request row 0 (the padding row) and position 0: a stale row
        or position would write KV into a live request's slot. out_cache_loc is written by the
        body for the whole bucket; its fill only keeps the rows past the bucket canonical.
        """
        self.input_ids.zero_()
        self.positions.zero_()
        self.out_cache_loc.fill_(PADDING_SLOT)
        self.seq_lens.fill_(SEQ_LEN_FILL_VALUE)
        self.seq_lens_cpu.fill_(SEQ_LEN_FILL_VALUE)
        self.req_pool_indices.fill_(PADDING_ROW)
        self.num_correct_drafts[:raw_bs].copy_(accept_lens - 1)
        self.num_accept_tokens[:raw_bs].copy_(accept_lens)  # unread here (the body selects by num_correct_drafts); the engine's backends read it

    def _copy_live_inputs(self, inp: DraftExtendInputs) -> None:
        """Real lanes only; padded lanes keep reset or stale values (§6.4)."""
        raw_n = inp.bs * self.T
        self.input_ids[:raw_n].copy_(inp.input_ids)
        self.positions[:raw_n].copy_(inp.positions)
        self.hidden_states[:raw_n].copy_(inp.hidden_states)
        self.seq_lens[: inp.bs].copy_(inp.seq_lens)
        self.seq_lens_cpu[: inp.bs].copy_(host_copy(inp.seq_lens_cpu, inp.seq_lens))
        self.req_pool_indices[: inp.bs].copy_(inp.req_pool_indices)

    def _fill_for_replay(self, inp: DraftExtendInputs) -> int:
        """Reset, copy-in and replay fill; returns the bucket. Device work and host copies only: no device sync when inp carries its host lengths."""
        bs = self._choose_bucket(self._needed_bs(inp))
        if self.prepare_fill is PrepareFill.TRITON:
            _fused_fill()(self.buffers, inp, bs, self.T)  # every device buffer the two methods below write
            self.seq_lens_cpu.fill_(SEQ_LEN_FILL_VALUE)  # the host mirror, as reset_for_iteration and _copy_live_inputs
            self.seq_lens_cpu[: inp.bs].copy_(host_copy(inp.seq_lens_cpu, inp.seq_lens))
            return bs
        self.reset_for_iteration(inp.bs, inp.accept_lens)
        self._copy_live_inputs(inp)
        if self.global_num_tokens_gpu is not None:
            self.global_num_tokens_gpu.fill_(bs * self.T)
            self.global_num_tokens_for_logprob_gpu.fill_(bs * self.T)
        return bs

    def replay(self, inp: DraftExtendInputs) -> StepOutputs:
        """Replays this step over the buffers as filled (prepare, then the chain inputs of earlier steps)."""
        return self._replay_filled(inp, self._choose_bucket(self._needed_bs(inp)))


class MultiLayerEagleDraftExtendCudaGraphRunner(EagleDraftExtendCudaGraphRunnerBase):
    """One draft layer (one speculative step) of the multi-layer EAGLE draft."""

    runner_kind = RunnerKind.MULTI_LAYER


class MultiStepDraftExtendComposite:
    """What both multi-layer composites do alike (the per-step one, runners.cuda_graph; the one-graph one,
    runners.one_graph_draft_extend): one buffer set, a step runner per draft layer over it, prepared once per
    iteration by the first step's runner. A subclass builds `runners` and says how the steps are captured and replayed."""

    runners: list[MultiLayerEagleDraftExtendCudaGraphRunner]

    def __init__(self, worker: DraftWorker):
        self.worker = worker
        self.buffers = DraftExtendInputBuffers.allocate(worker)
        self.raw_bs = self.bs = 0

    def capture(self) -> None:
        raise NotImplementedError

    def replay(self, step: int, inp: DraftExtendInputs) -> StepOutputs:
        raise NotImplementedError

    def can_run(self, inp: DraftExtendInputs) -> bool:
        return self.runners[0].can_run(inp)

    def prepare(self, inp: DraftExtendInputs) -> int:
        """Reset, copy-in and replay fill of the shared buffers, once per iteration; returns the bucket."""
        self.raw_bs, self.bs = inp.bs, self.runners[0].prepare_replay(inp)
        return self.bs
