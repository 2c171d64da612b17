"""Run a scenario's draft-extend on every rank of its layout: eager, graph, or both.

`run_rank` is the SPMD function (the same code for simulated and real ranks); it returns
plain CPU tensors and records so results can cross process boundaries.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Literal, Optional

import torch

from harness.observe import observe_all
from harness.records import ReplayRecord
from harness.scenario import MaterializedBatch, Scenario, materialize, release
from runners.draft_extend import DraftWorker
from runners.draft_extend_graph_driver import DraftExtendGraphDriver, run_draft_extend_eager
from runners.draft_parallel import draft_rank_context
from runners.graph.backend import GraphBackend, GraphStats
from runners.parallel.comm import Communicator
from runners.parallel.dp_attention import RankContext, mlp_sync_batch_sizes

RunnerChoice = Literal["eager", "graph", "both"]


@dataclass
class StepResult:
    tensors: dict[str, torch.Tensor]
    host: dict  # host metadata the step's ForwardBatch carried (eager) or baked (graph)


@dataclass
class RankRun:
    rank: int
    rids: list[list[int]] = field(default_factory=list)  # per iteration, this rank's requests in row order
    eager: list[list[StepResult]] = field(default_factory=list)  # [iteration][step]
    graph: list[list[StepResult]] = field(default_factory=list)
    records: list[list[ReplayRecord]] = field(default_factory=list)
    stats: Optional[GraphStats] = None


def _cpu(out) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").clone() for k, v in out.tensors().items()}


def make_worker(comm: Communicator, sc: Scenario, single_layer: bool, device: str) -> Optional[DraftWorker]:
    """This rank's draft worker, in the draft's own layout; None on a rank that holds no draft (SpecConfig.draft_tp_size)."""
    ctx = draft_rank_context(RankContext(sc.layout, comm.rank, comm), sc.spec)
    if ctx is None:
        return None
    return DraftWorker(ctx, sc.model, sc.spec, num_layers=1 if single_layer else None, attention_backend=sc.attention_backend, device=device)


def _prepare(worker: DraftWorker, sc: Scenario, it_idx: int) -> MaterializedBatch:
    batch = materialize(worker, sc, sc.iterations[it_idx])
    sizes = mlp_sync_batch_sizes(worker.ctx, batch.inputs.bs, worker.device)
    batch.inputs = replace(batch.inputs, dp_batch_sizes=sizes)
    return batch


def run_rank(
    comm: Communicator,
    sc: Scenario,
    runner: RunnerChoice = "both",
    single_layer: bool = False,
    graph_kind: str = "auto",
    device: str = "cpu",
    on_step: Optional[Callable[[int, int], None]] = None,
) -> RankRun:
    result = RankRun(rank=comm.rank)
    if draft_rank_context(RankContext(sc.layout, comm.rank, comm), sc.spec) is None:
        return result  # no draft on this rank: it runs no draft-extend (its group's first rank hands the proposals on)
    eager_worker = make_worker(comm, sc, single_layer, device) if runner in ("eager", "both") else None
    driver = observers = None
    if runner in ("graph", "both"):
        graph_worker = make_worker(comm, sc, single_layer, device)
        driver = DraftExtendGraphDriver(graph_worker, GraphBackend(graph_kind, device), single_layer=single_layer)
        observers = observe_all(driver.runners)  # before the capture: it records each bucket as baked
        driver.capture()
    for it in range(len(sc.iterations)):
        if eager_worker is not None:
            batch = _prepare(eager_worker, sc, it)
            outs, fbs = run_draft_extend_eager(eager_worker, batch.inputs)
            result.eager.append([StepResult(_cpu(o), fb.host_metadata()) for o, fb in zip(outs, fbs, strict=True)])
            result.rids.append(batch.rids)
            release(eager_worker, batch)
        if driver is not None:
            batch = _prepare(driver.worker, sc, it)
            outs = driver.run(batch.inputs)
            recs = observers[0].take()
            result.graph.append([StepResult(_cpu(o), rec.capture.host if rec else {}) for o, rec in zip(outs, recs or [None] * len(outs), strict=True)])
            result.records.append(recs)
            if eager_worker is None:
                result.rids.append(batch.rids)
            release(driver.worker, batch)
        if on_step is not None:
            on_step(comm.rank, it)
    result.stats = driver.stats if driver is not None else None
    return result
