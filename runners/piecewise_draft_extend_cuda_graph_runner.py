"""The multi-layer draft-extend under vLLM's PIECEWISE CUDA graphs: the dense parts of each step captured per token-count
bucket, the graph broken at attention, which runs eagerly over the live requests only.

vLLM 0.34 (v1/worker/gpu/cudagraph_utils.py) keys a PIECEWISE graph by its token count alone
(BatchExecutionDescriptor(num_tokens=n, num_reqs=None): "no request padding is needed"); the runner pads the batch's
token count to the captured size (num_tokens_after_padding, the dispatcher's choice), runs the dense pieces over the
padded rows, and builds the attention metadata for the live requests, which the break-point attention reads from the
forward context (the breakable CUDA graph). So here, per draft step and bucket:

- the token count of a live batch, raw_bs * T, is padded to the smallest captured size (`padded_num_tokens`): buckets
  are capture_bs * T tokens, and a graph exists for those sizes only; a count no graph was captured for runs eagerly
  (what vLLM does without a graph of that size), which the graph runners' replay counters show;
- the step body is the fixed-shape body (runners.draft_extend.draft_extend_step) recorded as a PiecewiseGraph
  (runners.graph.piecewise): everything before attention, then the attention as a graph break, then the rest; its
  attention backend is `PiecewiseAttention`, which bakes no metadata and, at each replay, attends over the live
  requests through the worker's backend with a batch built for them (`live_attention_batch`: the first
  `buffers.live_bs` lanes, their tokens);
- the dense pieces' own metadata (the gathered token counts the logits processor's DP gather reads) stays the padded
  count, baked at capture and filled at replay, as vLLM's num_tokens_across_dp counts padded tokens;
- the replay fill copies the live tokens and lanes in and nothing else: with no request padding the lanes past the
  live ones are stale from earlier, larger batches, harmless because no attention batch includes them (P2 poisons
  them); the dense pieces' padded token rows are row-wise and sliced off.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

import torch

from runners.attention.torch_ref import token_to_request
from runners.base_cuda_graph_runner import RunnerKind
from runners.batch import EagleDraftInput, ForwardBatch, ForwardMode, host_copy
from runners.draft_extend import (
    DraftExtendInputs,
    DraftWorker,
    StepOutputs,
    draft_extend_forward,
    draft_extend_step,
    eager_forward_batch,
)
from runners.draft_extend_cuda_graph_runner import DraftExtendInputBuffers
from runners.graph.backend import GraphBackend
from runners.graph.piecewise import graph_break
from runners.memory import assign_out_cache_loc
from runners.model import head_shard
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import (
    MultiLayerEagleDraftExtendCudaGraphRunner,
    MultiLayerEagleMultiStepDraftExtendCudaGraphRunner,
)


@dataclass
class PiecewiseDraftExtendInputBuffers(DraftExtendInputBuffers):
    """The draft-extend buffers, the attention output the pieces after the break read, and the forward context: how
    many lanes are live (the eager attention's batch)."""

    attn_out: Optional[torch.Tensor] = None  # [max_bs * T, local q heads, head_dim]
    live_bs: int = 0

    @classmethod
    def allocate(cls, worker: DraftWorker) -> "PiecewiseDraftExtendInputBuffers":
        buffers = cls(**vars(DraftExtendInputBuffers.allocate(worker)))
        cfg, ctx = worker.cfg, worker.ctx
        rows = buffers.input_ids.shape[0] if worker.model is not None else 0  # a metadata-only worker never attends
        heads = head_shard(cfg, ctx.attn_tp_rank, ctx.attn_tp_size).q_count
        buffers.attn_out = torch.zeros(rows, heads, cfg.head_dim, dtype=cfg.torch_dtype, device=worker.device)
        return buffers


class PiecewiseAttention:
    """The attention backend of the PIECEWISE body: no metadata inside the graph, every forward a graph break that
    attends eagerly over the live requests (PiecewiseDraftExtendCudaGraphRunner.attend_live) into a static output."""

    name = "piecewise"

    def __init__(self, runner: "PiecewiseDraftExtendCudaGraphRunner"):
        self.runner = runner

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        return None  # built eagerly for the live requests at every replay, never baked

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch, meta: None) -> torch.Tensor:
        out = self.runner.buffers.attn_out[: q.shape[0]]
        graph_break(lambda: self.runner.attend_live(layer, q, k, v, out))
        return out


class PiecewiseDraftExtendCudaGraphRunner(MultiLayerEagleDraftExtendCudaGraphRunner):
    """One draft layer under PIECEWISE graphs: the fixed-shape runner's buffers and batch, its token count padded to
    the captured size, the graph broken at attention, the fill writing only the live lanes (module doc)."""

    runner_kind = RunnerKind.PIECEWISE
    piecewise_graphs = True  # each bucket's graph: the pieces around the attention break

    def __init__(self, worker: DraftWorker, step: int, backend: GraphBackend, buffers: Optional[PiecewiseDraftExtendInputBuffers] = None):
        super().__init__(worker, step, backend, buffers if buffers is not None else PiecewiseDraftExtendInputBuffers.allocate(worker))
        self.attention = PiecewiseAttention(self)

    # ---- the dispatcher: the token count padded to a captured size ----
    def padded_num_tokens(self, num_tokens: int) -> int:
        """vLLM's num_tokens_after_padding: the smallest captured token count >= num_tokens."""
        sizes = [b * self.T for b in self.capture_bs]
        return sizes[min(bisect.bisect_left(sizes, num_tokens), len(sizes) - 1)]

    def _choose_bucket(self, needed: int) -> int:
        return self.padded_num_tokens(needed * self.T) // self.T

    def _step(self, fb: ForwardBatch) -> StepOutputs:
        self.buffers.live_bs = fb.batch_size  # capture and warm-up attend over the bucket; host code: no replay runs it
        return draft_extend_step(self.worker, self.step, fb, attn=self.attention)

    # ---- the graph break: attention over the live requests ----
    def live_attention_batch(self) -> ForwardBatch:
        """The batch the eager attention is built for: the live lanes (buffers.live_bs) and their tokens, never the
        bucket's padding."""
        b, bs = self.buffers, self.buffers.live_bs
        n = bs * self.T
        return ForwardBatch(
            forward_mode=ForwardMode.DRAFT_EXTEND_V2,
            batch_size=bs,
            input_ids=b.input_ids[:n],
            positions=b.positions[:n],
            seq_lens=b.seq_lens[:bs],
            seq_lens_cpu=b.seq_lens_cpu[:bs],
            req_pool_indices=b.req_pool_indices[:bs],
            out_cache_loc=b.out_cache_loc[:n],
            extend_seq_lens=b.extend_seq_lens[:bs],
            extend_start_loc=b.extend_start_loc[:bs],
            spec_info=EagleDraftInput(b.hidden_states[:n], b.num_correct_drafts[:bs], b.num_accept_tokens[:bs], self.worker.spec.topk),
            extend_seq_lens_cpu=[self.T] * bs,
            extend_num_tokens=n,
            num_token_non_padded=n,
            seq_lens_sum=int(b.seq_lens_cpu[:bs].sum()),
        )

    def attend_live(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        """The eager part of a replay: the live tokens' KV write slots and attention metadata, their attention into
        out's first rows. The padded rows keep what an earlier replay left: the pieces after the break are row-wise
        and those rows are sliced off (P2 poisons the padded token rows they come from)."""
        w = self.worker
        fb = self.live_attention_batch()
        n = fb.num_tokens
        assign_out_cache_loc(w.req_pool.req_to_token, fb.req_pool_indices, fb.positions, token_to_request(fb), fb.out_cache_loc,
                             w.req_pool.pad_slot)
        o = w.attn.forward(layer, q[:n], k[:n], v[:n], fb, w.attn.init_forward_metadata(fb))
        out[:n].copy_(o)

    # ---- replay: live lanes in, no request padding ----
    def _fill_for_replay(self, inp: DraftExtendInputs) -> int:
        """The live tokens and lanes copied in, the dense pieces' gathered counts for the padded bucket; nothing else."""
        bs = self._choose_bucket(self._needed_bs(inp))
        b, raw_bs = self.buffers, inp.bs
        raw_n = raw_bs * self.T
        b.input_ids[:raw_n].copy_(inp.input_ids)
        b.positions[:raw_n].copy_(inp.positions)
        b.hidden_states[:raw_n].copy_(inp.hidden_states)
        b.seq_lens[:raw_bs].copy_(inp.seq_lens)
        b.seq_lens_cpu[:raw_bs].copy_(host_copy(inp.seq_lens_cpu, inp.seq_lens))
        b.req_pool_indices[:raw_bs].copy_(inp.req_pool_indices)
        b.num_correct_drafts[:raw_bs].copy_(inp.accept_lens - 1)
        b.num_accept_tokens[:raw_bs].copy_(inp.accept_lens)  # unread here (the body selects by num_correct_drafts), as the fixed shape's
        if self.global_num_tokens_gpu is not None:
            self.global_num_tokens_gpu.fill_(bs * self.T)
            self.global_num_tokens_for_logprob_gpu.fill_(bs * self.T)
        b.live_bs = raw_bs
        return bs

    def replay(self, inp: DraftExtendInputs) -> StepOutputs:
        """The bucket's pieces over the buffers as filled; a token count with no captured graph runs eagerly."""
        bs = self._choose_bucket(self._needed_bs(inp))
        if bs not in self.graphs:
            self.backend.stats.eager_fallbacks += 1
            fb = eager_forward_batch(self.worker, inp, inp.input_ids, inp.hidden_states)
            return draft_extend_forward(self.worker, self.step, fb, inp.dp_batch_sizes)
        return self._replay_filled(inp, bs)


class PiecewiseMultiStepDraftExtendCudaGraphRunner(MultiLayerEagleMultiStepDraftExtendCudaGraphRunner):
    """The PIECEWISE runners of every draft step over one buffer set (and one forward context), prepared once per
    iteration by the first step's runner, the chain written between the steps on the host, as the per-step composite."""

    buffers_class = PiecewiseDraftExtendInputBuffers

    def _create_runner(self, step: int) -> PiecewiseDraftExtendCudaGraphRunner:
        return PiecewiseDraftExtendCudaGraphRunner(self.worker, step, self.backend, self.buffers)
