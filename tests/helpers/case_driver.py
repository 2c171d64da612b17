"""A case's multi-layer draft-extend driver captured on the recorded CPU graph, for the tests that drive it alone."""
from __future__ import annotations

from harness.run.scenario import Scenario
from runners.draft_extend import DraftWorker
from runners.draft_extend_graph_driver import DraftExtendGraphDriver
from runners.graph.backend import GraphBackend
from runners.parallel.dp_attention import RankContext


def captured_driver(comm, sc: Scenario) -> DraftExtendGraphDriver:
    """Call on a rank of the case's layout (inside a SimulatedWorld)."""
    ctx = RankContext(sc.layout, comm.rank, comm)
    driver = DraftExtendGraphDriver(DraftWorker(ctx, sc.model, sc.spec, attention_backend=sc.attention_backend), GraphBackend("sim"))
    driver.capture()
    return driver
