"""The multi-layer EAGLE draft-extend CUDA-graph runners, as SGLang's file of the same name holds them: the per-step
runner (MultiLayerEagleDraftExtendCudaGraphRunner: one draft layer, its get_forward_batch and the replay fill), the
composite that owns one buffer set and a runner per step (MultiLayerEagleMultiStepDraftExtendCudaGraphRunner: a graph
per step, chained on the host) and its one-graph variant (OneGraphMultiLayerEagleMultiStepDraftExtendCudaGraphRunner:
one graph per bucket runs every step). Their replay fill, line by line: docs/replay-fill.md.

Static buffers sized for the largest bucket; one graph per capture_bs bucket; `get_forward_batch(bs)` bakes the
per-branch metadata; the replay fill copies only the live lanes in and writes the gathered gpu tensors; each step
replays and slices the raw rows out. Padded lanes keep their reset or stale values on purpose: that is what the engine
does, and what the harness must prove harmless.

Where ours differs in shape from the engine's: the fill is the step runner's, not the composite's `prepare`, so that a
step runner made alone (as P1's metadata path drives one) fills its own buffers; inside a composite the first step's
runner fills the shared set. The buffer layout and what the single-layer runner
(runners.eagle_draft_extend_cuda_graph_runner) does alike are runners.draft_extend_cuda_graph_runner's.

The fill has two paths, as the engine's: on a CUDA worker one fused Triton launch (runners.draft_extend_fill) in
place of the fill's many small torch launches; on any other device the torch methods below, its native twin, which
the CPU suite and the built-in mutants exercise. Both leave the device buffers bitwise alike. The runner picks its
path once, at construction, from the worker's device.
"""
from __future__ import annotations

import importlib
from enum import Enum
from typing import Any, Callable, Optional

import torch

from runners.base_cuda_graph_runner import WARMUPS, RunnerKind
from runners.batch import EagleDraftInput, ForwardBatch, ForwardMode, host_copy
from runners.dp_metadata import GatheredMetadata
from runners.draft_extend import SEQ_LEN_FILL_VALUE, DraftExtendInputs, DraftWorker, StepOutputs, draft_extend_step
from runners.draft_extend_cuda_graph_runner import DraftExtendCudaGraphRunner, DraftExtendInputBuffers
from runners.graph.backend import GraphBackend
from runners.parallel.comm import Group


class PrepareFill(Enum):
    """How a multi-layer runner writes its per-iteration fill: torch ops, or the one fused launch
    (runners.draft_extend_fill, whose module imports triton: the runner imports it on the fused path only)."""

    NATIVE = "native"
    TRITON = "triton"

    @classmethod
    def for_device(cls, device: torch.device | str) -> "PrepareFill":
        """The engine's choice: the kernel where it is compiled for the device (CUDA), the torch ops elsewhere."""
        return cls.TRITON if torch.device(device).type == "cuda" else cls.NATIVE


def _fused_fill() -> Callable[[DraftExtendInputBuffers, DraftExtendInputs, int, int], None]:
    """The fused fill's launcher, imported on the fused path only: its module imports triton, an optional package
    (runners.attention imports its backends the same way), and a CPU process must not pay for it or have it set
    TRITON_INTERPRET."""
    return importlib.import_module("runners.draft_extend_fill").fill_prepare_buffers


class MultiLayerEagleDraftExtendCudaGraphRunner(DraftExtendCudaGraphRunner):
    """One draft layer (one speculative step) of the multi-layer EAGLE draft: its get_forward_batch and the fill of
    the (shared) buffers.

    A runner made alone (buffers=None) owns its buffers and fills them itself through
    prepare_replay; inside MultiLayerEagleMultiStepDraftExtendCudaGraphRunner the first
    step's runner fills the shared set once per iteration and every step replays over it.
    `prepare_fill` says how the fill is written (runners.draft_extend_fill); a test may pin it.
    """

    runner_kind = RunnerKind.MULTI_LAYER

    def __init__(self, worker: DraftWorker, step: int, backend: GraphBackend, buffers: Optional[DraftExtendInputBuffers] = None):
        super().__init__(worker, step, backend, buffers)
        self.prepare_fill = PrepareFill.for_device(worker.device)

    # ---- metadata, per branch ----
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

    # ---- the replay fill ----
    def reset_for_iteration(self, raw_bs: int, accept_lens: torch.Tensor) -> None:
        """Once per decode iteration, before the first step: reset token buffers, seq lens and request rows.

        The step body looks each token's KV write location up as
        req_to_token[req_pool_indices[lane], position] and gathers its rotary row by position,
        so a padded lane must hold request row 0 (the padding row) and position 0: a stale row
        or position would write KV into a live request's slot. out_cache_loc is written by the
        body for the whole bucket; its fill only keeps the rows past the bucket canonical.
        """
        self.buffers.reset_to_padding(self.worker.pad)  # vLLM's convention: the pad request -1, whose tokens write PAD_SLOT_ID
        self.num_correct_drafts[:raw_bs].copy_(accept_lens - 1)
        self.num_accept_tokens[:raw_bs].copy_(accept_lens)  # unread here (the body selects by num_correct_drafts); the engine's backends read it

    def _copy_live_inputs(self, inp: DraftExtendInputs) -> None:
        """Real lanes only; padded lanes keep reset or stale values."""
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
            _fused_fill()(self.buffers, inp, bs, self.T, self.worker.pad)  # every device buffer the two methods below write
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


class MultiLayerEagleMultiStepDraftExtendCudaGraphRunner:
    """Owns the one buffer set and the per-step runners that read it: prepare once per iteration (the first step's
    runner fills the set), then per step write the chain inputs and replay that step's graph."""

    buffers_class: type[DraftExtendInputBuffers] = DraftExtendInputBuffers  # vLLM's shapes keep more (runners.ragged_*, piecewise_*)

    def __init__(self, worker: DraftWorker, backend: GraphBackend):
        self.worker, self.backend = worker, backend
        self.buffers = self.buffers_class.allocate(worker)
        self.raw_bs = self.bs = 0
        self.runners = [self._create_runner(k) for k in range(worker.num_layers)]

    def _create_runner(self, step: int) -> MultiLayerEagleDraftExtendCudaGraphRunner:
        return MultiLayerEagleDraftExtendCudaGraphRunner(self.worker, step, self.backend, self.buffers)

    def capture(self) -> None:
        for r in reversed(self.runners):  # the engine captures the last step first
            r.capture()

    def can_run(self, inp: DraftExtendInputs) -> bool:
        return self.runners[0].can_run(inp)

    def prepare(self, inp: DraftExtendInputs) -> int:
        """Reset, copy-in and replay fill of the shared buffers, once per iteration; returns the bucket."""
        self.raw_bs, self.bs = inp.bs, self.runners[0].prepare_replay(inp)
        return self.bs

    def replay(self, step: int, inp: DraftExtendInputs) -> StepOutputs:
        """Step k > 0 reads the previous step's token ids and hidden states (`inp`, live rows):
        written outside the graph, as the engine's worker rotates the input ids between steps."""
        if step:
            raw_n = inp.bs * self.runners[0].T
            self.buffers.input_ids[:raw_n].copy_(inp.input_ids)
            self.buffers.hidden_states[:raw_n].copy_(inp.hidden_states)
        return self.runners[step].replay(inp)


class OneGraphDraftExtendStepRunner(MultiLayerEagleDraftExtendCudaGraphRunner):
    """One step of the one-graph composite: its metadata and fill are a per-step runner's; its graph is the composite's
    (kept by the first step's runner, as SGLang's first runner's backend keeps it), and a later step's replay is served
    from step 0's. SGLang serves the steps in the composite's replay; here the step runner's replay does, so that a
    step's outputs are sliced by the same `_replay_filled` as a per-step replay's."""

    def __init__(self, worker: DraftWorker, step: int, backend: GraphBackend, buffers: DraftExtendInputBuffers,
                 composite: "OneGraphMultiLayerEagleMultiStepDraftExtendCudaGraphRunner"):
        super().__init__(worker, step, backend, buffers)
        self.composite = composite

    def capture(self) -> None:
        raise RuntimeError("a step of the one-graph composite is captured by the composite, with every other step")

    def _replay_graph(self, bs: int, attn: Any) -> StepOutputs:
        """This step's (unsliced) outputs of the iteration's one replay: step 0 runs it."""
        if self.step == 0:
            self.composite.served = super()._replay_graph(bs, attn)
        return self.composite.served[self.step]


class OneGraphMultiLayerEagleMultiStepDraftExtendCudaGraphRunner(MultiLayerEagleMultiStepDraftExtendCudaGraphRunner):
    """SGLang's one-graph composite (SGLANG_ENABLE_SINGLE_CG_DRAFT, its default on FA3 from 0.5.16): ONE graph per
    bucket captures every step's body and the chain between the steps, so an iteration replays once. It owns the
    buffer set, a logits buffer per step and the step runners.

    What it keeps of the per-step composite: one buffer set, prepared once per iteration by the first step's runner;
    each step's get_forward_batch. What differs, and why each piece is here:

    - the chain (step k+1 reads step k's next token ids and hidden states) is written INSIDE the graph, after each
      step's body. Written on the host between steps, as the per-step composite does, it would come too late: the
      replay has run every step by then, each later step over the inputs step 0 read (mutant
      one-graph-chain-on-host, P3).
    - each step writes its logits into a buffer of its own. The per-step runners share one logits buffer, which is
      right for them (the driver copies a step's outputs before the next replay); inside one graph step k+1 would
      overwrite step k's logits before anyone reads them (mutant one-graph-steps-share-logits, P3).
    - the replay runs at step 0; every step's outputs come from that replay (`served`), sliced to the raw batch by
      the step's runner as a per-step replay's are (mutant one-graph-served-unsliced, P3).

    SGLang snapshots the chain's buffers (token ids, hidden states) before capture and restores them after it, outside
    the graph, because the warm-ups ran the chain for real. There is no restore here because our prepare leaves nothing
    for one to guard: the reset zeroes every token id and the copy-in rewrites every live hidden state, so what the
    warm-ups' chain leaves survives only in the padded lanes' hidden states, stale by design (an earlier larger batch
    leaves them so) and read by no live row (P2 poisons them; tests/test_one_graph_draft_extend.py poisons the chain
    buffers after capture and no output changes).
    """

    def __init__(self, worker: DraftWorker, backend: GraphBackend):
        super().__init__(worker, backend)
        shared = self.buffers.next_token_logits_buffer
        self.step_logits = [shared] + [torch.zeros_like(shared) for _ in self.runners[1:]]
        self.served: list[StepOutputs] = []

    def _create_runner(self, step: int) -> OneGraphDraftExtendStepRunner:
        return OneGraphDraftExtendStepRunner(self.worker, step, self.backend, self.buffers, self)

    def _logits_buffer(self, step: int) -> torch.Tensor:
        return self.step_logits[step]

    def _chain(self, num_tokens: int, out: StepOutputs) -> None:
        """The next step's inputs, in the graph: every lane of the bucket (the graph cannot know the raw batch)."""
        self.buffers.input_ids[:num_tokens].copy_(out.next_input_ids)
        self.buffers.hidden_states[:num_tokens].copy_(out.hidden)

    def _body(self, bs: int, batches: list[ForwardBatch]) -> list[StepOutputs]:
        n, last = bs * self.runners[0].T, len(batches) - 1
        outs = []
        for step, fb in enumerate(batches):
            out = draft_extend_step(self.worker, step, fb)
            logits = self._logits_buffer(step)[:n]
            logits.copy_(out.logits)
            out.logits = logits
            outs.append(out)
            if step < last:
                self._chain(n, out)
        return outs

    def capture(self) -> None:
        """Largest bucket first, as the engine; its warm-ups (WARMUPS) with the capture-time metadata, a barrier after each."""
        first = self.runners[0]
        for bs in reversed(first.capture_bs):
            batches = [r.get_forward_batch(bs).frozen() for r in self.runners]
            for r, fb in zip(self.runners, batches, strict=True):
                r.capture_batches[bs] = fb
                r.init_capture_metadata(fb)
            for _ in range(WARMUPS):
                self.backend.warmup(lambda bs=bs, batches=batches: self._body(bs, batches))
                first.comm.barrier(Group.WORLD)
            first.graphs[bs] = self.backend.capture(lambda bs=bs, batches=batches: self._body(bs, batches))

    def replay(self, step: int, inp: DraftExtendInputs) -> StepOutputs:
        """Step 0 replays the one graph; a later step is served from that replay. `inp` carries the previous step's
        outputs for a host chain; this composite chains in the graph and writes nothing here."""
        return self.runners[step].replay(inp)
