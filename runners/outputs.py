"""What a runner hands back, and how a consumer keeps it.

Under a graph the outputs are views of the graph's static output buffers, sliced to the raw
batch: the engine's replay returns them so, without a copy, and the next replay of the same
graph overwrites them (the CPU graph writes its outputs in place too: runners.graph.record), as
may a replay of a graph of the same pool captured before it (runners.graph.pool). A consumer
that reads them before the next replay needs nothing; one that keeps them past it (a loop
step's report, a property comparing two replays) takes `cloned()`.
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Self

import torch


class RunnerOutputs:
    """Mixed into the runners' output dataclasses."""

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: t for f in fields(self) if isinstance(t := getattr(self, f.name), torch.Tensor)}

    def cloned(self) -> Self:
        return replace(self, **{name: t.clone() for name, t in self.tensors().items()})
