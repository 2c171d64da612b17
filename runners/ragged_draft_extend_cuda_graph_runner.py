"""The ragged draft-extend's CUDA-graph runners: a runner per draft step over one shared buffer set, as the per-step
composite of the multi-layer draft (runners.multi_layer_eagle_draft_extend_cuda_graph_runner), with vLLM's shape inside
each graph (runners.ragged_draft_extend: packed accepted tokens, the last-token gather index).

Buckets are request buckets (capture_bs), each graph holding bs * T token rows: every request contributes at most T.
What the replay fill writes, once per iteration (`RaggedDraftExtendCudaGraphRunner._fill_for_replay`):
  tokens [0, N)            the live requests' accepted tokens, packed; every other row 0 (ids, positions)
  extend_start_loc,        live lanes: their packed extents; padded lanes of the bucket: one padding token each
  extend_seq_lens
  last_token_indices       live lanes: their last accepted row; padded lanes: their own padding token (the gather
                           index is absolute, so a stale one from a larger batch names a live request's row, which the
                           body then overwrites with the padded lane's proposal; vLLM pads the tail of the same buffer
                           for its graphs, prepare_prefill_inputs)
  seq_lens                 live lanes: the batch's (prefix + T, as vLLM's drafter keeps the target's seq_lens: each
                           token sees keys up to its own position only); padded lanes the fill value
  req_pool_indices         live lanes their rows; padded lanes the convention's pad row
  gathered counts          bs * T, as baked
The per-lane accept counts of the fixed shape (num_correct_drafts, num_accept_tokens) are neither read nor written: the
ragged body selects through the gather index.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from runners.base_cuda_graph_runner import RunnerKind
from runners.batch import EagleDraftInput, ForwardBatch, host_copy
from runners.draft_extend import DraftExtendInputs, DraftWorker, StepOutputs
from runners.draft_extend_cuda_graph_runner import DraftExtendInputBuffers
from runners.graph.backend import GraphBackend
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import (
    MultiLayerEagleDraftExtendCudaGraphRunner,
    MultiLayerEagleMultiStepDraftExtendCudaGraphRunner,
)
from runners.ragged_draft_extend import RaggedPlan, ragged_draft_extend_step, unpacked


@dataclass
class RaggedDraftExtendInputBuffers(DraftExtendInputBuffers):
    """The draft-extend buffers plus the persistent last-token gather index ([max_bs], vLLM's last_token_indices)."""

    last_token_indices: Optional[torch.Tensor] = None

    @classmethod
    def allocate(cls, worker: DraftWorker) -> "RaggedDraftExtendInputBuffers":
        base = DraftExtendInputBuffers.allocate(worker)
        buffers = cls(**vars(base))
        max_bs = buffers.seq_lens.shape[0]
        lanes = torch.arange(max_bs, dtype=torch.int64, device=worker.device)
        # every lane padded: one padding token each, selecting it (what the fill gives a bucket with no live request)
        buffers.extend_start_loc.copy_(lanes)
        buffers.extend_seq_lens.fill_(1)
        buffers.last_token_indices = lanes.clone()
        return buffers


class RaggedDraftExtendCudaGraphRunner(MultiLayerEagleDraftExtendCudaGraphRunner):
    """One draft layer of the ragged draft-extend: its get_forward_batch, the ragged fill of the shared buffers and the
    ragged body. Inside the composite the first step's runner fills the set once per iteration."""

    runner_kind = RunnerKind.RAGGED

    def __init__(self, worker: DraftWorker, step: int, backend: GraphBackend, buffers: Optional[RaggedDraftExtendInputBuffers] = None):
        worker.spec.check_layout(worker.ctx.layout)
        super().__init__(worker, step, backend, buffers if buffers is not None else RaggedDraftExtendInputBuffers.allocate(worker))
        self.plan: Optional[RaggedPlan] = None  # the live batch's layout, set by the fill

    def get_forward_batch(self, bs: int) -> ForwardBatch:
        """The fixed-shape runner's batch (same counts: bs * T token rows, every one gets logits), with the ragged lane
        extents and the gather index in the spec info."""
        fb = super().get_forward_batch(bs)
        info = fb.spec_info
        fb.spec_info = EagleDraftInput(info.hidden_states, info.num_correct_drafts, info.num_accept_tokens, info.topk,
                                       self.buffers.last_token_indices[:bs])
        return fb

    def _step(self, fb: ForwardBatch) -> StepOutputs:
        return ragged_draft_extend_step(self.worker, self.step, fb)

    # ---- the replay fill ----
    def _fill_for_replay(self, inp: DraftExtendInputs) -> int:
        bs = self._choose_bucket(self._needed_bs(inp))
        self.plan = plan = RaggedPlan.of(inp, self.T)
        b, raw_bs, n, dev = self.buffers, inp.bs, plan.num_tokens, self.worker.device
        rows = plan.index(dev)
        b.reset_to_padding(self.worker.pad)
        b.input_ids[:n].copy_(inp.input_ids[rows])
        b.positions[:n].copy_(inp.positions[rows])
        b.hidden_states[:n].copy_(inp.hidden_states[rows])
        b.seq_lens[:raw_bs].copy_(inp.seq_lens)  # as the verify's (vLLM's drafter reuses the target's): positions mask the rest
        b.seq_lens_cpu[:raw_bs].copy_(host_copy(inp.seq_lens_cpu, inp.seq_lens))
        b.req_pool_indices[:raw_bs].copy_(inp.req_pool_indices)
        pad_starts, pad_lens, pad_last = plan.padded(bs)
        self._write_lanes(b.extend_start_loc, plan.starts + pad_starts, dev)
        self._write_lanes(b.extend_seq_lens, list(plan.accept_lens) + pad_lens, dev)
        self._write_lanes(b.last_token_indices, plan.last_token_indices + pad_last, dev)
        if self.global_num_tokens_gpu is not None:
            self.global_num_tokens_gpu.fill_(bs * self.T)
            self.global_num_tokens_for_logprob_gpu.fill_(bs * self.T)
        return bs

    @staticmethod
    def _write_lanes(buffer: torch.Tensor, values: list[int], device: torch.device) -> None:
        """The bucket's lanes [0, len(values)); lanes past the bucket are never read by its graph."""
        buffer[: len(values)].copy_(torch.tensor(values, dtype=torch.int64, device=device))

    def replay(self, inp: DraftExtendInputs) -> StepOutputs:
        """This step over the buffers as filled; its outputs request-major (runners.ragged_draft_extend.unpacked)."""
        bs = self._choose_bucket(self._needed_bs(inp))
        out: StepOutputs = self._replay_graph(bs, self.worker.attn)
        return unpacked(out, self.plan, self.worker.device)


class RaggedMultiStepDraftExtendCudaGraphRunner(MultiLayerEagleMultiStepDraftExtendCudaGraphRunner):
    """The ragged runners of every draft step over one buffer set: prepared once per iteration by the first step's
    runner; between steps the previous step's token ids and hidden states (request-major) are packed in again."""

    buffers_class = RaggedDraftExtendInputBuffers

    def _create_runner(self, step: int) -> RaggedDraftExtendCudaGraphRunner:
        return RaggedDraftExtendCudaGraphRunner(self.worker, step, self.backend, self.buffers)

    def replay(self, step: int, inp: DraftExtendInputs) -> StepOutputs:
        first = self.runners[0]
        if step:
            rows, n = first.plan.index(self.worker.device), first.plan.num_tokens
            self.buffers.input_ids[:n].copy_(inp.input_ids[rows])
            self.buffers.hidden_states[:n].copy_(inp.hidden_states[rows])
        runner = self.runners[step]
        runner.plan = first.plan
        return runner.replay(inp)
