"""SGLang's one-graph multi-layer draft-extend composite (OneGraphMultiLayerEagleMultiStepDraftExtendCudaGraphRunner,
SGLANG_ENABLE_SINGLE_CG_DRAFT, its default on FA3 from 0.5.16): ONE graph per bucket captures every step's body and
the chain between the steps, so an iteration replays once.

What it shares with the per-step composite (runners.cuda_graph): one buffer set, prepared once per iteration by the
first step's runner; each step's get_forward_batch. What differs, and why each piece is here:

- the chain (step k+1 reads step k's next token ids and hidden states) is written INSIDE the graph, after each step's
  body. Written on the host between steps, as the per-step driver does, it would come too late: the replay has run
  every step by then, each later step over the inputs step 0 read (mutant one-graph-chain-on-host, P3).
- each step writes its logits into a buffer of its own. The per-step runners share one logits buffer, which is right
  for them (the driver copies a step's outputs before the next replay); inside one graph step k+1 would overwrite
  step k's logits before anyone reads them (mutant one-graph-steps-share-logits, P3).
- the replay runs at step 0; every step's outputs come from that replay (the composite's `served`), sliced to the
  raw batch by the step's runner as a per-step replay's are (mutant one-graph-served-unsliced, P3).

SGLang snapshots the chain's buffers (token ids, hidden states) before capture and restores them after it, outside
the graph, because the warm-ups ran the chain for real. There is no restore here because our prepare leaves nothing for
one to guard: the reset zeroes every token id and the copy-in rewrites every live hidden state, so what the warm-ups'
chain leaves survives only in the padded lanes' hidden states, stale by design (an earlier larger batch leaves them so)
and read by no live row (P2 poisons them; tests/test_one_graph_draft_extend.py poisons the chain buffers after capture
and no output changes).
"""
from __future__ import annotations

from typing import Any

import torch

from runners.batch import ForwardBatch
from runners.draft_extend import DraftExtendInputs, DraftWorker, StepOutputs, draft_extend_step
from runners.draft_extend_buffers import DraftExtendInputBuffers
from runners.graph_backend import GraphBackend
from runners.multi_layer_draft_extend_graph import (
    MultiLayerEagleDraftExtendCudaGraphRunner,
    MultiStepDraftExtendComposite,
)
from runners.parallel.comm import Group


class OneGraphDraftExtendStepRunner(MultiLayerEagleDraftExtendCudaGraphRunner):
    """One step of the one-graph composite: its metadata and fill are a per-step runner's; its graph is the composite's
    (kept by the first step's runner, as SGLang's first runner's backend keeps it), and a later step's replay is served
    from step 0's."""

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


class OneGraphMultiLayerEagleMultiStepDraftExtendCudaGraphRunner(MultiStepDraftExtendComposite):
    """Owns the buffer set, a logits buffer per step and the step runners; one graph per bucket runs them all."""

    def __init__(self, worker: DraftWorker, backend: GraphBackend):
        super().__init__(worker)
        self.backend = backend
        self.runners = [OneGraphDraftExtendStepRunner(worker, k, backend, self.buffers, self) for k in range(worker.num_layers)]
        shared = self.buffers.next_token_logits_buffer
        self.step_logits = [shared] + [torch.zeros_like(shared) for _ in self.runners[1:]]
        self.served: list[StepOutputs] = []

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
        """Largest bucket first, as the engine; two warm-ups with the capture-time metadata, a barrier after each."""
        first = self.runners[0]
        for bs in reversed(first.capture_bs):
            batches = [r.get_forward_batch(bs).frozen() for r in self.runners]
            for r, fb in zip(self.runners, batches, strict=True):
                r.capture_batches[bs] = fb
            for _ in range(2):
                self.backend.warmup(lambda bs=bs, batches=batches: self._body(bs, batches))
                first.comm.barrier(Group.WORLD)
            first.graphs[bs] = self.backend.capture(lambda bs=bs, batches=batches: self._body(bs, batches))

    def replay(self, step: int, inp: DraftExtendInputs) -> StepOutputs:
        """Step 0 replays the one graph; a later step is served from that replay. `inp` carries the previous step's
        outputs for a host chain; this composite chains in the graph and writes nothing here."""
        return self.runners[step].replay(inp)
