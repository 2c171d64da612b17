"""Graph capture/replay: torch.cuda.CUDAGraph on a GPU, a recording graph on CPU.

The CPU graph (runners.graph.record.RecordedGraph) captures by recording the ops the body
launches and replays that record: host values are the ones baked at capture, tensors
are the static buffers' current contents, and the captured outputs are overwritten in
place, as a real graph leaves them. No Python of the body runs at replay, so nothing
the body reads on the host (the live batch, a runner attribute) can reach a replay.
"""
from __future__ import annotations

import copy
import gc
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from runners.graph.piecewise import PiecewiseGraph
from runners.graph.pool import RecordedPool
from runners.graph.record import RecordedGraph


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    eager_fallbacks: int = 0


_gc_lock = threading.Lock()
_gc_holders = 0
_gc_was_enabled = False


@contextmanager
def no_gc_during_capture() -> Iterator[None]:
    """Keep Python's cyclic collector from running while a CUDA graph is being captured.

    torch >= 2.5 no longer gc.collect()s before capture (torch.compiler.config.force_cudagraph_gc),
    so a dead reference cycle that owns a CUDAGraph (every runner is one: graph -> body ->
    runner -> graphs) can be collected in the middle of someone else's capture, and destroying
    that graph there invalidates the capture (cudaErrorStreamCaptureInvalidated, at whatever
    kernel happens to come next). SGLang's cuda_graph_runner freezes the GC around capture for
    the same reason. Process-wide (the collector is) and re-entrant across threads: the collector
    comes back, as it was, when the last capture ends; the garbage is collected then.
    """
    global _gc_holders, _gc_was_enabled
    with _gc_lock:
        if _gc_holders == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holders += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_holders -= 1
            if _gc_holders == 0 and _gc_was_enabled:
                gc.enable()


class CudaGraph:
    kind = "cuda"

    def __init__(self, body: Callable[[], Any], pool: Any, stream: "torch.cuda.Stream"):
        self.body, self.pool, self.stream = body, pool, stream
        self.graph = torch.cuda.CUDAGraph()
        self.output: Any = None

    def capture(self) -> Any:
        with no_gc_during_capture(), torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            self.output = self.body()
        return self.output

    def replay(self) -> None:
        self.graph.replay()


class GraphBackend:
    """Makes graphs of one kind; `auto` is cuda when the runner's device is a GPU."""

    def __init__(self, kind: str = "auto", device: torch.device | str = "cpu"):
        device = torch.device(device)
        if kind == "auto":
            kind = "cuda" if device.type == "cuda" else "sim"
        if kind == "cuda" and device.type != "cuda":
            raise ValueError("graph backend 'cuda' needs a CUDA device; use 'sim' on CPU")
        if kind not in ("sim", "cuda"):
            raise ValueError(f"unknown graph backend {kind!r}: expected auto, sim or cuda")
        self.kind = kind
        self.stats = GraphStats()
        # one pool for every graph of this backend, on a GPU and (simulated: runners.graph.pool) on CPU
        self.pool = torch.cuda.graph_pool_handle() if kind == "cuda" else RecordedPool()
        self.stream = torch.cuda.Stream(device) if kind == "cuda" else None

    def sibling(self) -> "GraphBackend":
        """A backend for another graph runner of the same rank: stats of its own, this backend's pool and stream. SGLang's
        runners (the target's and the draft's) all capture into one global graph pool, so one runner's outputs may sit
        in memory another runner's graphs freed at capture (runners.graph.pool)."""
        other = copy.copy(self)
        other.stats = GraphStats()
        return other

    def warmup(self, body: Callable[[], Any]) -> Any:
        if self.kind == "cuda":
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                out = body()
            torch.cuda.current_stream().wait_stream(self.stream)
            return out
        return body()

    def capture(self, body: Callable[[], Any], piecewise: bool = False) -> RecordedGraph | CudaGraph:
        """One graph of `body`; piecewise: broken at the body's graph_break calls (runners.graph.piecewise)."""
        if piecewise and self.kind == "cuda":
            raise ValueError("PIECEWISE graphs are recorded on CPU only (the 'sim' graph backend): the CUDA kind captures FULL graphs")
        if piecewise:
            g: RecordedGraph | CudaGraph = PiecewiseGraph(body, self.pool)
        else:
            g = CudaGraph(body, self.pool, self.stream) if self.kind == "cuda" else RecordedGraph(body, self.pool)
        g.capture()
        self.stats.captures += 1
        return g

    def replay(self, graph: RecordedGraph | CudaGraph) -> None:
        graph.replay()
        self.stats.replays += 1
