"""What every CUDA-graph runner of the engine does the same way: capture per bucket, choose a bucket.

Draft-extend and target verify differ in their buffers, their `get_forward_batch(bs)` and
their replay fill; they share the capture loop (two warm-ups with the capture-time
metadata, a barrier after each, then the capture, largest bucket first, DESIGN.md §6.2) and
the bucket rule (the smallest captured bs >= the batch; in the MLP-TP gather branch every
DP group replays the same bucket, so the largest group's batch decides, §6.4).
"""
from __future__ import annotations

import bisect
from typing import Any, Protocol

from runners.batch import ForwardBatch
from runners.graph_backend import GraphBackend
from runners.parallel.comm import Group
from runners.parallel.layout import Branch, ParallelLayout


class LiveBatch(Protocol):
    dp_batch_sizes: list[int]

    @property
    def bs(self) -> int: ...


class BucketedGraphRunner:
    """Subclasses set layout, backend, capture_bs, max_bs, graphs, capture_batches and define
    `comm`, `get_forward_batch(bs)` and `_body(fb)`."""

    layout: ParallelLayout
    backend: GraphBackend
    capture_bs: list[int]
    max_bs: int
    graphs: dict[int, Any]
    capture_batches: dict[int, ForwardBatch]

    @property
    def comm(self):
        raise NotImplementedError

    def get_forward_batch(self, bs: int) -> ForwardBatch:
        raise NotImplementedError

    def _body(self, fb: ForwardBatch) -> Any:
        raise NotImplementedError

    def capture(self) -> None:
        for bs in reversed(self.capture_bs):
            fb = self.get_forward_batch(bs).frozen()
            self.capture_batches[bs] = fb
            for _ in range(2):  # warm-up, as the engine does, with the capture-time metadata
                self.backend.warmup(lambda fb=fb: self._body(fb))
                self.comm.barrier(Group.WORLD)
            self.graphs[bs] = self.backend.capture(lambda fb=fb: self._body(fb))

    def can_run(self, inp: LiveBatch) -> bool:
        return self._needed_bs(inp) <= self.max_bs

    def _needed_bs(self, inp: LiveBatch) -> int:
        if self.layout.branch is Branch.MLP_TP_GATHER:
            return max(inp.dp_batch_sizes)  # every DP group must replay the same bucket
        return inp.bs

    def _choose_bucket(self, needed: int) -> int:
        return self.capture_bs[bisect.bisect_left(self.capture_bs, needed)]
