"""DraftExtendGraphDriver: runs a draft worker's draft-extend through its CUDA-graph runners, with eager fallback, and
picks which runners: the multi-layer composite the spec names (a graph per step, or SGLang's one graph per bucket:
SpecConfig.draft_extend_graph, runners.multi_layer_eagle_draft_extend_cuda_graph_runner; vLLM's shapes of the per-step
one: SpecConfig.draft_extend_shape ragged, runners.ragged_draft_extend_cuda_graph_runner, or SpecConfig.cuda_graph_mode
piecewise, runners.piecewise_draft_extend_cuda_graph_runner) or the single-layer runner
(runners.eagle_draft_extend_cuda_graph_runner). The engine's draft worker makes the same choice when it builds its
graphs; here it sits apart so that the proposer, the harness and the benchmarks drive the runners one way.
`run_draft_extend_eager` is the eager pass of the same shape: the reference every graph of it is held to.
"""
from __future__ import annotations

from typing import Optional

from runners.attention.kinds import METADATA_IN_GRAPH, ONE_GRAPH_UNSUPPORTED, RAGGED_UNSUPPORTED
from runners.config import CudaGraphMode, DraftExtendGraph, DraftExtendShape, DraftKind, SpecConfig
from runners.draft_extend import DraftExtendInputs, DraftWorker, StepOutputs, run_eager, with_step_inputs
from runners.draft_extend_cuda_graph_runner import DraftExtendCudaGraphRunner
from runners.eagle_draft_extend_cuda_graph_runner import EAGLEDraftExtendCudaGraphRunner
from runners.graph.backend import GraphBackend
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import (
    MultiLayerEagleMultiStepDraftExtendCudaGraphRunner,
    OneGraphMultiLayerEagleMultiStepDraftExtendCudaGraphRunner,
)
from runners.piecewise_draft_extend_cuda_graph_runner import PiecewiseMultiStepDraftExtendCudaGraphRunner
from runners.ragged_draft_extend import run_eager_ragged
from runners.ragged_draft_extend_cuda_graph_runner import RaggedMultiStepDraftExtendCudaGraphRunner

COMPOSITES: dict[DraftExtendGraph, type[MultiLayerEagleMultiStepDraftExtendCudaGraphRunner]] = {
    DraftExtendGraph.PER_STEP: MultiLayerEagleMultiStepDraftExtendCudaGraphRunner,
    DraftExtendGraph.ONE_GRAPH: OneGraphMultiLayerEagleMultiStepDraftExtendCudaGraphRunner,
}


def multi_layer_composite(spec: SpecConfig) -> type[MultiLayerEagleMultiStepDraftExtendCudaGraphRunner]:
    """The multi-layer composite of a spec: vLLM's shapes are per-step composites (SpecConfig validates the combination)."""
    if spec.draft_extend_shape is DraftExtendShape.RAGGED:
        return RaggedMultiStepDraftExtendCudaGraphRunner
    if spec.cuda_graph_mode is CudaGraphMode.PIECEWISE:
        return PiecewiseMultiStepDraftExtendCudaGraphRunner
    return COMPOSITES[spec.draft_extend_graph]


def run_draft_extend_eager(worker: DraftWorker, inp: DraftExtendInputs) -> tuple[list[StepOutputs], list]:
    """The eager draft-extend of the worker's shape: the ragged pass for a ragged spec, DRAFT_EXTEND_V2 otherwise
    (a PIECEWISE graph's eager pass is the fixed-shape one: the pieces are its body)."""
    if worker.spec.draft_extend_shape is DraftExtendShape.RAGGED:
        return run_eager_ragged(worker, inp)
    return run_eager(worker, inp)


class DraftExtendGraphDriver:
    """Runs a worker's draft-extend through its graph runners, with eager fallback.

    The multi-layer driver holds the composite the spec names (SpecConfig.draft_extend_graph): a
    MultiLayerEagleMultiStepDraftExtendCudaGraphRunner (num_steps per-step graphs over one buffer set,
    chained here) or a OneGraphMultiLayerEagleMultiStepDraftExtendCudaGraphRunner (one graph, chained in
    it); the single-layer one holds one EAGLEDraftExtendCudaGraphRunner. `runners` lists the step
    runners either way.
    """

    def __init__(self, worker: DraftWorker, backend: GraphBackend, single_layer: bool = False):
        self.worker, self.backend = worker, backend
        self.multi_step: Optional[MultiLayerEagleMultiStepDraftExtendCudaGraphRunner] = None
        if single_layer or worker.spec.draft is DraftKind.EAGLE3:  # an EAGLE3 draft is one layer: the single-layer runner's
            self.runners: list[DraftExtendCudaGraphRunner] = [EAGLEDraftExtendCudaGraphRunner(worker, backend)]
        else:
            if worker.spec.draft_extend_graph is DraftExtendGraph.ONE_GRAPH and worker.attn.name not in METADATA_IN_GRAPH:
                raise ValueError(f"attention backend {worker.attn.name}: {ONE_GRAPH_UNSUPPORTED}")
            if worker.spec.draft_extend_shape is DraftExtendShape.RAGGED and worker.attn.name not in METADATA_IN_GRAPH:
                raise ValueError(f"attention backend {worker.attn.name}: {RAGGED_UNSUPPORTED}")
            self.multi_step = multi_layer_composite(worker.spec)(worker, backend)
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
            outs, _ = run_draft_extend_eager(self.worker, inp)
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
        (runners.graph.pool). The engine's worker clones each step's top-k before the next step for that reason;
        the caller here keeps every output of every step (the proposal, the loop's report). Under the one-graph
        composite nothing replays between its steps' outputs, each in memory of its own, so the copies guard
        nothing there; they keep one loop for both composites."""
        return out.cloned()
