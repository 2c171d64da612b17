"""Graph outputs poisoned once the engine step that produced them is over: a kept view reads the poison.

The runners hand back views of their graphs' outputs (runners.outputs), as the engines' replays do; the next replay
of the graph (or of an earlier-captured graph of its pool) overwrites them. A consumer that keeps such a view past
that point reads another iteration's data, which a property comparing right after the step (P8) never sees: the
overwrite has not happened yet. So, after each engine step of a graphed session (the loop's own consumers had
their chance to copy), every output tensor of every captured graph is overwritten with poison: NaN for floats, the
dtype's minimum for integers (no token id, index or count), flipped for booleans. What the loop kept by copy is
untouched; what it kept as a view reads poison wherever it is read next. The next replay writes its outputs whole,
as it always does, so the runners never read the poison.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from harness.run.observe import LoopObserver


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    """The tensors of a graph's output: a tensor, a runner's output dataclass (runners.outputs), or a list of them."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            yield from _tensors(o)
    elif hasattr(out, "tensors"):
        yield from out.tensors().values()


def poison_tensor(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.logical_not_()
    else:
        t.fill_(torch.iinfo(t.dtype).min)


class OutputPoison:
    """Poisons the outputs of every graph of the runners a LoopObserver watches (one rank's engine)."""

    def __init__(self, observer: LoopObserver):
        self.runners = [o.runner for group in (observer.extend, observer.verify, observer.decode) for o in group]
        self.poisoned = 0  # tensors overwritten so far

    def graph_outputs(self) -> Iterable[torch.Tensor]:
        seen: set[int] = set()
        for r in self.runners:
            for g in r.graphs.values():
                if id(g) not in seen:  # the one-graph composite's steps serve one graph
                    seen.add(id(g))
                    yield from _tensors(g.output)

    def poison(self) -> None:
        for t in self.graph_outputs():
            poison_tensor(t)
            self.poisoned += 1
