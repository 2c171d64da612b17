"""The one place the harness builds our runners: a scenario's rig on one rank, and the runners without a model.

`Rig` (scenario -> eager worker, graph driver on a worker of its own, observers) serves every run of a scenario:
`run_rank`, the SPMD function of a case run (the same code for simulated and real ranks), and `harness replay
--dump`. Its results are typed (`StepResult` holds the runners' own StepOutputs) and CPU-resident, so they cross
process boundaries. The metadata functions build one rank's graph runners with no weights or pools: what P1's fast
path drives through get_forward_batch and the replay prepare.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Literal, Optional

from harness.run.observe import RunnerObserver, observe_all
from harness.run.records import ReplayRecord
from harness.run.scenario import MaterializedBatch, Scenario, materialize, release
from runners.config import CudaGraphMode, DraftExtendShape, ModelConfig, SpecConfig
from runners.decode_cuda_graph_runner import DecodeCudaGraphRunner
from runners.draft_extend import DraftExtendInputs, DraftWorker, StepOutputs
from runners.draft_extend_graph_driver import DraftExtendGraphDriver, multi_layer_composite, run_draft_extend_eager
from runners.draft_parallel import draft_rank_context
from runners.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
from runners.eagle_draft_extend_cuda_graph_runner import EAGLEDraftExtendCudaGraphRunner
from runners.graph.backend import GraphBackend, GraphStats
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import MultiLayerEagleDraftExtendCudaGraphRunner
from runners.parallel.comm import Communicator
from runners.parallel.dp_attention import RankContext, mlp_sync_batch_sizes
from runners.parallel.layout import ParallelLayout

RunnerChoice = Literal["eager", "graph", "both"]


@dataclass
class StepResult:
    out: StepOutputs  # the step's outputs, real rows, on the CPU
    host: dict  # the host metadata its ForwardBatch carried (eager) or baked (graph), under the engine's names


@dataclass
class RankRun:
    rank: int
    rids: list[list[int]] = field(default_factory=list)  # per iteration, this rank's requests in row order
    eager: list[list[StepResult]] = field(default_factory=list)  # [iteration][step]
    graph: list[list[StepResult]] = field(default_factory=list)
    records: list[list[ReplayRecord]] = field(default_factory=list)
    stats: Optional[GraphStats] = None


@dataclass
class IterationRun:
    """One iteration on one rank, on the rig's device: valid until the next iteration overwrites the runners' outputs."""

    inputs: DraftExtendInputs  # the live batch (the eager worker's when it ran, else the graph's)
    rids: list[int]
    eager: Optional[list[StepOutputs]] = None
    eager_host: list[dict] = field(default_factory=list)  # per step, the eager ForwardBatch's host metadata
    graph: Optional[list[StepOutputs]] = None
    records: list[ReplayRecord] = field(default_factory=list)  # per graph replay, observed


def make_worker(comm: Communicator, sc: Scenario, single_layer: bool, device: str) -> Optional[DraftWorker]:
    """This rank's draft worker, in the draft's own layout; None on a rank that holds no draft (SpecConfig.draft_tp_size)."""
    ctx = draft_rank_context(RankContext(sc.layout, comm.rank, comm), sc.spec)
    if ctx is None:
        return None
    return DraftWorker(ctx, sc.model, sc.spec, num_layers=1 if single_layer else None, attention_backend=sc.attention_backend, device=device)


def prepare(worker: DraftWorker, sc: Scenario, it_idx: int) -> MaterializedBatch:
    """Iteration it_idx's requests written into the worker's pools, with the scheduler's MLP sync of batch sizes."""
    batch = materialize(worker, sc, sc.iterations[it_idx])
    sizes = mlp_sync_batch_sizes(worker.ctx, batch.inputs.bs, worker.device)
    batch.inputs = replace(batch.inputs, dp_batch_sizes=sizes)
    return batch


class Rig:
    """One rank's runners for a scenario: an eager worker, a graph driver on a worker of its own (captured, its runners
    observed from before the capture, so each bucket is recorded as baked), or both side by side. A rank that holds
    no draft (SpecConfig.draft_tp_size: its group's first rank hands the proposals on) runs no draft-extend."""

    def __init__(self, comm: Communicator, sc: Scenario, runner: RunnerChoice = "both", single_layer: bool = False,
                 graph_kind: str = "auto", device: str = "cpu"):
        self.sc = sc
        self.holds_draft = draft_rank_context(RankContext(sc.layout, comm.rank, comm), sc.spec) is not None
        self.eager = make_worker(comm, sc, single_layer, device) if self.holds_draft and runner in ("eager", "both") else None
        self.driver: Optional[DraftExtendGraphDriver] = None
        self.observers: list[RunnerObserver] = []
        if self.holds_draft and runner in ("graph", "both"):
            self.driver = DraftExtendGraphDriver(make_worker(comm, sc, single_layer, device), GraphBackend(graph_kind, device),
                                                 single_layer=single_layer)
            self.observers = observe_all(self.driver.runners)
            self.driver.capture()

    def iteration(self, it: int) -> IterationRun:
        run: Optional[IterationRun] = None
        if self.eager is not None:
            batch = prepare(self.eager, self.sc, it)
            outs, fbs = run_draft_extend_eager(self.eager, batch.inputs)
            run = IterationRun(batch.inputs, batch.rids, list(outs), [fb.host_metadata() for fb in fbs])
            release(self.eager, batch)
        if self.driver is not None:
            batch = prepare(self.driver.worker, self.sc, it)
            outs = self.driver.run(batch.inputs)
            run = run or IterationRun(batch.inputs, batch.rids)
            run.graph, run.records = list(outs), self.observers[0].take()
            release(self.driver.worker, batch)
        assert run is not None, "a rig runs eager, graph or both"
        return run


def _cpu(out: StepOutputs) -> StepOutputs:
    return replace(out, **{k: v.detach().to("cpu").clone() for k, v in out.tensors().items()})


def run_rank(
    comm: Communicator,
    sc: Scenario,
    runner: RunnerChoice = "both",
    single_layer: bool = False,
    graph_kind: str = "auto",
    device: str = "cpu",
    on_step: Optional[Callable[[int, int], None]] = None,
) -> RankRun:
    rig = Rig(comm, sc, runner, single_layer, graph_kind, device)
    result = RankRun(rank=comm.rank)
    if not rig.holds_draft:
        return result  # no draft on this rank: it runs no draft-extend
    for it in range(len(sc.iterations)):
        run = rig.iteration(it)
        result.rids.append(run.rids)
        if run.eager is not None:
            result.eager.append([StepResult(_cpu(o), h) for o, h in zip(run.eager, run.eager_host, strict=True)])
        if run.graph is not None:
            recs = run.records or [None] * len(run.graph)
            result.graph.append([StepResult(_cpu(o), rec.capture.host if rec else {}) for o, rec in zip(run.graph, recs, strict=True)])
            result.records.append(run.records)
        if on_step is not None:
            on_step(comm.rank, it)
    result.stats = rig.driver.stats if rig.driver is not None else None
    return result


# ---- one rank's graph runners without a model (no weights, no pools, no collectives): P1's fast path ----


def draft_extend_runners(layout: ParallelLayout, spec: SpecConfig, model: ModelConfig, tp_rank: int) -> list[MultiLayerEagleDraftExtendCudaGraphRunner]:
    """Each multi-layer draft-extend step's runner (vLLM's shapes: the composite's step runners over its one buffer set),
    then the single-layer draft-extend runner; in the draft's own layout (SpecConfig.draft_tp_size)."""
    ctx = draft_rank_context(RankContext(layout, tp_rank, comm=None), spec)
    backend = GraphBackend("sim")
    multi = DraftWorker(ctx, model, spec, build_model=False)
    single = DraftWorker(ctx, model, spec, num_layers=1, build_model=False)
    if spec.draft_extend_shape is DraftExtendShape.FIXED and spec.cuda_graph_mode is CudaGraphMode.FULL:
        runners: list[MultiLayerEagleDraftExtendCudaGraphRunner] = [
            MultiLayerEagleDraftExtendCudaGraphRunner(multi, k, backend) for k in range(spec.num_steps)
        ]
    else:
        runners = list(multi_layer_composite(spec)(multi, backend).runners)
    runners.append(EAGLEDraftExtendCudaGraphRunner(single, backend))
    return runners


def verify_runner(layout: ParallelLayout, spec: SpecConfig, model: ModelConfig, tp_rank: int) -> DecodeCudaGraphRunner:
    return DecodeCudaGraphRunner(RankContext(layout, tp_rank, comm=None), model, spec, None, GraphBackend("sim"))


def decode_runner(layout: ParallelLayout, spec: SpecConfig, model: ModelConfig, tp_rank: int) -> Optional[EAGLEDraftCudaGraphRunner]:
    """The draft-decode runner of one rank, in the draft's own layout; None on a rank that holds no draft."""
    ctx = draft_rank_context(RankContext(layout, tp_rank, comm=None), spec)
    if ctx is None:
        return None
    return EAGLEDraftCudaGraphRunner(DraftWorker(ctx, model, spec, num_layers=1, build_model=False), GraphBackend("sim"))
