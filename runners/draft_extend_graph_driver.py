"""EAGLE draft-extend CUDA-graph composites: the multi-layer one with a graph per step (runners over one shared buffer
set, chained on the host between steps), and the driver that runs any kind: that one, SGLang's one graph per bucket
(runners.one_graph_draft_extend, chosen by SpecConfig.draft_extend_graph) or the single-layer runner.

The step runner itself (get_forward_batch, the replay fill) is runners.multi_layer_draft_extend_graph; DESIGN.md §6.2-6.4.
"""
from __future__ import annotations

from typing import Optional

from runners.attention.kinds import METADATA_IN_GRAPH, ONE_GRAPH_UNSUPPORTED
from runners.config import DraftExtendGraph
from runners.draft_extend import DraftExtendInputs, DraftWorker, StepOutputs, run_eager, with_step_inputs
from runners.draft_extend_buffers import DraftExtendGraphRunner
from runners.eagle_draft_extend_graph import EagleDraftExtendCudaGraphRunner
from runners.graph_backend import GraphBackend
from runners.graph_runner import compute_capture_bs
from runners.multi_layer_draft_extend_graph import (
    EagleDraftExtendCudaGraphRunnerBase,
    MultiLayerEagleDraftExtendCudaGraphRunner,
    MultiStepDraftExtendComposite,
)
from runners.one_graph_draft_extend import OneGraphMultiLayerEagleMultiStepDraftExtendCudaGraphRunner

__all__ = [
    "DraftExtendGraphDriver", "EagleDraftExtendCudaGraphRunner", "EagleDraftExtendCudaGraphRunnerBase",
    "MultiLayerEagleDraftExtendCudaGraphRunner", "MultiLayerEagleMultiStepDraftExtendCudaGraphRunner",
    "OneGraphMultiLayerEagleMultiStepDraftExtendCudaGraphRunner", "compute_capture_bs",
]


class MultiLayerEagleMultiStepDraftExtendCudaGraphRunner(MultiStepDraftExtendComposite):
    """Owns the one buffer set and the per-step runners that read it: prepare once per iteration,
    then per step write the chain inputs and replay that step's graph."""

    def __init__(self, worker: DraftWorker, backend: GraphBackend):
        super().__init__(worker)
        self.runners = [MultiLayerEagleDraftExtendCudaGraphRunner(worker, k, backend, self.buffers) for k in range(worker.num_layers)]

    def capture(self) -> None:
        for r in reversed(self.runners):  # the engine captures the last step first
            r.capture()

    def replay(self, step: int, inp: DraftExtendInputs) -> StepOutputs:
        """Step k > 0 reads the previous step's token ids and hidden states (`inp`, live rows):
        written outside the graph, as the engine's worker rotates the input ids between steps."""
        if step:
            raw_n = inp.bs * self.runners[0].T
            self.buffers.input_ids[:raw_n].copy_(inp.input_ids)
            self.buffers.hidden_states[:raw_n].copy_(inp.hidden_states)
        return self.runners[step].replay(inp)


COMPOSITES: dict[DraftExtendGraph, type[MultiStepDraftExtendComposite]] = {
    DraftExtendGraph.PER_STEP: MultiLayerEagleMultiStepDraftExtendCudaGraphRunner,
    DraftExtendGraph.ONE_GRAPH: OneGraphMultiLayerEagleMultiStepDraftExtendCudaGraphRunner,
}


class DraftExtendGraphDriver:
    """Runs a worker's draft-extend through its graph runners, with eager fallback.

    The multi-layer driver holds the composite the spec names (SpecConfig.draft_extend_graph): a
    MultiLayerEagleMultiStepDraftExtendCudaGraphRunner (num_steps per-step graphs over one buffer set,
    chained here) or a OneGraphMultiLayerEagleMultiStepDraftExtendCudaGraphRunner (one graph, chained in
    it); the single-layer one holds one EagleDraftExtendCudaGraphRunner. `runners` lists the step
    runners either way.
    """

    def __init__(self, worker: DraftWorker, backend: GraphBackend, single_layer: bool = False):
        self.worker, self.backend = worker, backend
        self.multi_step: Optional[MultiStepDraftExtendComposite] = None
        if single_layer:
            self.runners: list[DraftExtendGraphRunner] = [EagleDraftExtendCudaGraphRunner(worker, backend)]
        else:
            if worker.spec.draft_extend_graph is DraftExtendGraph.ONE_GRAPH and worker.attn.name not in METADATA_IN_GRAPH:
                raise ValueError(f"attention backend {worker.attn.name}: {ONE_GRAPH_UNSUPPORTED}")
            composite = COMPOSITES[worker.spec.draft_extend_graph]
            self.multi_step = composite(worker, backend)
            self.runners = list(self.multi_step.runners)

    @property
    def stats(self):
        return self.backend.stats

    def capture(self) -> None:
        if self.multi_step is not None:
            self.multi_step.capture()
        else:
            self.runners[0].capture()

    def run(self, inp: DraftExtendInputs) -> list[StepOutputs]:
        if not all(r.can_run(inp) for r in self.runners):
            self.backend.stats.eager_fallbacks += 1
            outs, _ = run_eager(self.worker, inp)
            return outs[: len(self.runners)]
        if self.multi_step is None:
            return [self.runners[0].replay(inp)]
        self.multi_step.prepare(inp)
        outs = []
        step_inp = inp
        last = len(self.runners) - 1
        for k in range(len(self.runners)):
            out = self.multi_step.replay(k, step_inp)
            step_inp = with_step_inputs(inp, out.next_input_ids, out.hidden)
            outs.append(self.kept(out) if k < last else out)
        return outs

    @staticmethod
    def kept(out: StepOutputs) -> StepOutputs:
        """A step's outputs as the caller keeps them past the later steps' replays, copied: the steps share the logits
        buffer (DraftExtendInputBuffers), and their graphs one graph pool, captured last step first, so a step's
        outputs may sit in memory a later step's graph frees at capture and rewrites at every replay
        (runners.graph_pool). The engine's worker clones each step's top-k before the next step for that reason;
        the caller here keeps every output of every step (the proposal, the loop's report). Under the one-graph
        composite nothing replays between its steps' outputs, each in memory of its own, so the copies guard
        nothing there; they keep one loop for both composites."""
        return out.cloned()
