"""PIECEWISE graphs on CPU: a body recorded in pieces, broken wherever it calls `graph_break`.

vLLM's PIECEWISE CUDA graphs (v1/worker/gpu/cudagraph_utils.py: CUDAGraphMode.PIECEWISE, run_pw_graph; the breakable
CUDA graph of vllm.compilation) capture the model's dense parts per token count and leave attention out of the graph:
at replay the pieces are replayed and the attention between them runs eagerly, reading the live batch from the forward
context, not from anything baked at capture. `PiecewiseGraph` does that on the recording graph (runners.graph.record):
capture runs the body once under the recorder; a `graph_break(fn)` inside it closes the piece recorded so far, runs
`fn` eagerly (unrecorded: host reads are its business, as a recorded op's are) and opens the next piece. A replay
replays each piece and, between them, calls each break's `fn` again. `fn` writes its result in place into tensors the
next piece reads (by identity, as every recorded op does), so the pieces see what the eager part computed at this
replay.

Outside a capture (eager warm-ups, the eager path) `graph_break(fn)` just calls `fn`.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from torch.utils._python_dispatch import _pop_mode_temporarily

from runners.graph.pool import RecordedPool
from runners.graph.record import RecordedGraph, _capturing_as

_state = threading.local()  # .graph: the PiecewiseGraph this thread is capturing


def graph_break(fn: Callable[[], None]) -> None:
    """Run `fn` eagerly at every replay (inside a PIECEWISE capture), or now (anywhere else)."""
    graph: Optional[PiecewiseGraph] = getattr(_state, "graph", None)
    if graph is None:
        fn()
        return
    graph._break(fn)


class PiecewiseGraph(RecordedGraph):
    """A RecordedGraph whose recorded ops are split at the body's graph breaks (module doc)."""

    kind = "sim-piecewise"

    def __init__(self, body: Callable[[], Any], pool: Optional[RecordedPool] = None):
        super().__init__(body, pool)
        self.breaks: list[tuple[int, Callable[[], None]]] = []  # (ops recorded before the break, the eager part)
        self._recorder_ops: Optional[list] = None

    def capture(self) -> Any:
        if getattr(_state, "graph", None) is not None:
            raise RuntimeError("a PIECEWISE capture inside another one")
        _state.graph = self
        try:
            return super().capture()
        finally:
            _state.graph = None

    def _break(self, fn: Callable[[], None]) -> None:
        """Called from inside the recorder's mode: note where the piece ends, then run `fn` with the recorder popped."""
        with _pop_mode_temporarily() as recorder:
            self.breaks.append((len(recorder.ops), fn))
            with _capturing_as(False):
                fn()

    @property
    def num_pieces(self) -> int:
        return len(self.breaks) + 1

    def replay(self) -> None:
        at = 0
        for end, fn in self.breaks:
            self._replay_ops(at, end)
            fn()
            at = end
        self._replay_ops(at, len(self._calls))
