"""EAGLE draft-extend CUDA-graph runners: multi-layer (one runner per step) and single-layer.

Mirrors the engine's structure (DESIGN.md §6.2-6.4): static buffers sized for the
largest bucket; one graph per capture_bs bucket; `get_forward_batch(bs)` bakes the
per-branch metadata; replay copies only the live lanes in, writes the replay fill into
the gathered gpu tensors, replays and slices the raw rows out. Padded lanes keep their
reset or stale values on purpose: that is what the engine does, and what the harness
must prove harmless.
"""
from __future__ import annotations

from typing import Optional

import torch

from runners.batch import EagleDraftInput, ForwardBatch, ForwardMode
from runners.dp_metadata import gathered_metadata
from runners.draft_extend import (
    SEQ_LEN_FILL_VALUE,
    DraftExtendInputs,
    DraftWorker,
    StepOutputs,
    draft_extend_step,
    run_eager,
    with_step_inputs,
)
from runners.graph_backend import GraphBackend
from runners.graph_runner import BucketedGraphRunner, CaptureRecord, ReplayRecord, compute_capture_bs
from runners.memory import PADDING_ROW, PADDING_SLOT


class EagleDraftExtendCudaGraphRunnerBase(BucketedGraphRunner):
    def __init__(self, worker: DraftWorker, step: int, backend: GraphBackend):
        self.worker, self.step, self.backend = worker, step, backend
        self.layout = worker.ctx.layout
        self.T = worker.tokens_per_bs
        self.capture_bs = compute_capture_bs(self.layout, worker.spec.capture_bs, worker.spec.max_running_requests)
        self.max_bs = max(self.capture_bs)
        n, dev, cfg = self.max_bs * self.T, worker.device, worker.cfg
        i64 = dict(dtype=torch.int64, device=dev)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.out_cache_loc = torch.full((n,), PADDING_SLOT, **i64)
        self.seq_lens = torch.full((self.max_bs,), SEQ_LEN_FILL_VALUE, **i64)
        self.req_pool_indices = torch.zeros(self.max_bs, **i64)
        self.num_correct_drafts = torch.ones(self.max_bs, **i64)
        self.num_accept_tokens = torch.ones(self.max_bs, **i64)
        self.extend_seq_lens = torch.full((self.max_bs,), self.T, **i64)
        self.extend_start_loc = torch.arange(self.max_bs, **i64) * self.T
        self.hidden_states = torch.zeros(n, cfg.hidden_size, dtype=cfg.torch_dtype, device=dev)
        # Output only; a metadata-only worker (no model) never runs the body, so skips its 256 KiB.
        logits_rows = n if worker.model is not None else 0
        self.next_token_logits_buffer = torch.zeros(logits_rows, cfg.vocab_size, dtype=torch.float32, device=dev)
        self._init_gathered(dev)
        self.graphs: dict[int, object] = {}
        self.capture_batches: dict[int, ForwardBatch] = {}  # the frozen batch each bucket's graph was captured with
        self.capture_records: dict[int, CaptureRecord] = {}

    # ---- metadata, per branch (§6.3) ----
    def _capture_num_tokens(self, bs: int) -> int:
        return bs * self.T

    def _capture_for_logprob(self, bs: int) -> int:
        """DRAFT_EXTEND_V2 emits logits for every token: the logprob count is the token count."""
        return bs * self.T

    def _replay_fill_tokens(self, bs: int) -> int:
        return bs * self.T

    def get_forward_batch(self, bs: int) -> ForwardBatch:
        n = bs * self.T
        dp = self.layout.attn_dp_size
        num_tokens, lp_tokens = self._capture_num_tokens(bs), self._capture_for_logprob(bs)
        meta = gathered_metadata(self.layout, [num_tokens] * dp, [lp_tokens] * dp, self.worker.ctx.attn_dp_rank)
        self._bake_gathered(meta)
        fb = ForwardBatch(
            forward_mode=ForwardMode.DRAFT_EXTEND_V2,
            batch_size=bs,
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            seq_lens=self.seq_lens[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            out_cache_loc=self.out_cache_loc[:n],
            extend_seq_lens=self.extend_seq_lens[:bs],
            extend_start_loc=self.extend_start_loc[:bs],
            spec_info=EagleDraftInput(self.hidden_states[:n], self.num_correct_drafts[:bs], self.num_accept_tokens[:bs], self.worker.spec.topk),
            extend_seq_lens_cpu=[self.T] * bs,
            extend_num_tokens=n,
            num_token_non_padded=n,
            seq_lens_sum=bs * SEQ_LEN_FILL_VALUE,
            global_num_tokens_cpu=meta.global_num_tokens,
            global_num_tokens_gpu=self.global_num_tokens_gpu,
            global_num_tokens_for_logprob_cpu=meta.global_num_tokens_for_logprob,
            global_num_tokens_for_logprob_gpu=self.global_num_tokens_for_logprob_gpu,
            global_dp_buffer_len=meta.global_dp_buffer_len,
        )
        return self._keep_capture_record(fb)

    # ---- capture (§6.2) ----
    def _body(self, fb: ForwardBatch) -> StepOutputs:
        out = draft_extend_step(self.worker, self.step, fb)
        n = fb.batch_size * self.T
        self.next_token_logits_buffer[:n].copy_(out.logits)
        out.logits = self.next_token_logits_buffer[:n]
        return out

    @property
    def comm(self):
        return self.worker.ctx.comm

    # ---- replay (§6.4) ----
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
        self.req_pool_indices.fill_(PADDING_ROW)
        self.num_correct_drafts[:raw_bs].copy_(accept_lens - 1)
        self.num_accept_tokens[:raw_bs].copy_(accept_lens)

    def _copy_live_inputs(self, inp: DraftExtendInputs) -> None:
        """Real lanes only; padded lanes keep reset or stale values (§6.4)."""
        raw_n = inp.bs * self.T
        self.input_ids[:raw_n].copy_(inp.input_ids)
        self.positions[:raw_n].copy_(inp.positions)
        self.hidden_states[:raw_n].copy_(inp.hidden_states)
        self.seq_lens[: inp.bs].copy_(inp.seq_lens)
        self.req_pool_indices[: inp.bs].copy_(inp.req_pool_indices)

    def prepare_replay(self, inp: DraftExtendInputs) -> ReplayRecord:
        """Copy in, choose the bucket, write the replay fill. No graph runs (the fast P1 path)."""
        return self._record(inp, self._fill_for_replay(inp))

    def _fill_for_replay(self, inp: DraftExtendInputs) -> int:
        """Copy-in and replay fill; returns the bucket. Device work only: no host sync."""
        bs = self._choose_bucket(self._needed_bs(inp))
        self._copy_live_inputs(inp)
        if self.global_num_tokens_gpu is not None:
            self.global_num_tokens_gpu.fill_(self._replay_fill_tokens(bs))
            self.global_num_tokens_for_logprob_gpu.fill_(self._replay_fill_tokens(bs))
        return bs

    def replay(self, inp: DraftExtendInputs, record: bool = True) -> tuple[StepOutputs, Optional[ReplayRecord]]:
        bs = self._fill_for_replay(inp)
        rec = self._record(inp, bs) if record else None
        out: StepOutputs = self._replay_graph(bs, self.worker.attn, rec)
        return out.sliced(inp.bs, self.T), rec


class MultiLayerEagleDraftExtendCudaGraphRunner(EagleDraftExtendCudaGraphRunnerBase):
    """One draft layer (one speculative step) of the multi-layer EAGLE draft."""

    runner_kind = "multi_layer"


class EagleDraftExtendCudaGraphRunner(EagleDraftExtendCudaGraphRunnerBase):
    """The single-layer EAGLE draft-extend runner (step 0 only)."""

    runner_kind = "single_layer"

    def __init__(self, worker: DraftWorker, backend: GraphBackend):
        super().__init__(worker, 0, backend)


class DraftExtendGraphDriver:
    """Runs a worker's draft-extend through its graph runners, one per step, with eager fallback.

    The multi-layer driver holds num_steps MultiLayerEagleDraftExtendCudaGraphRunner (as the
    engine's MultiLayerEagleMultiStepDraftExtendCudaGraphRunner); the single-layer one holds one
    EagleDraftExtendCudaGraphRunner.
    """

    def __init__(self, worker: DraftWorker, backend: GraphBackend, single_layer: bool = False, record: bool = True):
        """record=False skips the ReplayRecords (P1's host read-back, a few device syncs per step):
        the driver then runs as an engine would, and `run` returns no records."""
        self.worker, self.backend, self.record = worker, backend, record
        if single_layer:
            self.runners: list[EagleDraftExtendCudaGraphRunnerBase] = [EagleDraftExtendCudaGraphRunner(worker, backend)]
        else:
            self.runners = [MultiLayerEagleDraftExtendCudaGraphRunner(worker, k, backend) for k in range(worker.num_layers)]

    @property
    def stats(self):
        return self.backend.stats

    def capture(self) -> None:
        for r in self.runners:
            r.capture()

    def run(self, inp: DraftExtendInputs) -> tuple[list[StepOutputs], list[ReplayRecord]]:
        if not all(r.can_run(inp) for r in self.runners):
            self.backend.stats.eager_fallbacks += 1
            outs, _ = run_eager(self.worker, inp)
            return outs[: len(self.runners)], []
        for r in self.runners:
            r.reset_for_iteration(inp.bs, inp.accept_lens)
        outs, records = [], []
        step_inp = inp
        for r in self.runners:
            out, rec = r.replay(step_inp, record=self.record)
            outs.append(out)
            if rec is not None:
                records.append(rec)
            step_inp = with_step_inputs(inp, out.next_input_ids, out.hidden)
        return outs, records
