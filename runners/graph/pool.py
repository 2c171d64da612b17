"""The CPU graph's memory pool, shared by the graphs of one GraphBackend as their CUDA graph pool is.

On a GPU the graphs of one pool (torch.cuda.graph_pool_handle; SGLang's runners all capture into
its global graph pool) are captured one after another into one private allocator pool, and what
a capture frees, every tensor it made but the ones still referenced after it (its outputs), the
next capture may allocate again. A replay writes every tensor its capture made, so replaying a
graph overwrites the outputs of graphs captured after it that were placed in its freed memory: a
consumer that holds one graph's output past another graph's replay must copy it first (SGLang's
multi-layer worker clones each step's top-k before the next step replays, for that reason).

RecordedGraphs that each owned fresh tensors could never show that. So a capture into a
RecordedPool places each tensor it makes in a block an earlier capture freed whenever one is large
enough (best fit, a whole block per tensor): the reuse a caching allocator may make, made every
time it can, so that code which holds an output across replays only by luck fails on CPU. What a
capture made, its outputs aside, is free when it ends.

One difference, deliberate: on a GPU a tensor the body stashed somewhere else (an attribute) stays
allocated, because it is still referenced; here only what the body returns is kept. A body must hand
out through its return value whatever is read outside the graph, which every runner here does; a
stash read outside the graph would read another graph's data on CPU (stricter than a GPU, not looser).
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
from typing import Any, Iterator

import torch


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor a body's return value holds: in dataclasses (the runners' outputs), tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name))
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_in(x)


class RecordedPool:
    """Blocks freed by the captures into this pool, handed to the next ones (module doc)."""

    def __init__(self) -> None:
        # (nbytes, order freed, block): sorted, so the best fit is a bisection away; among equal sizes the block
        # freed first is taken, as a scan of the free list in the order it was freed would
        self.free: list[tuple[int, int, torch.UntypedStorage]] = []
        self._order = itertools.count()
        self.placed = 0  # tensors a capture placed in an earlier capture's freed block

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """`t`, a tensor a capture just made, moved into the smallest freed block that holds it (or `t` itself).

        Only a tensor that is its storage, whole, moves: a new result (an op's fresh output), not a view of something.
        """
        if not self.free or t.layout != torch.strided:
            return t
        storage = t.untyped_storage()
        need = storage.nbytes()
        if not need or need != t.numel() * t.element_size() or t.storage_offset() or not t.is_contiguous():
            return t
        free = self.free
        i = bisect.bisect_left(free, (need, -1))
        device = storage.device
        while i < len(free) and free[i][2].device != device:
            i += 1
        if i == len(free):
            return t
        block = free.pop(i)[2]
        moved = t.new_empty(0).set_(block, 0, t.shape, t.stride())
        moved.copy_(t)
        self.placed += 1
        return moved

    def release(self, made: list[torch.Tensor], outputs: Any) -> None:
        """The end of a capture: the blocks of every tensor it made, but its outputs', are free again."""
        held = {o.untyped_storage().data_ptr() for o in tensors_in(outputs)}
        freed = []
        for t in made:
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr not in held:
                held.add(ptr)  # one block once, however many tensors of the capture view it
                freed.append((s.nbytes(), next(self._order), s))
        self.free += freed
        self.free.sort()  # one sort, not an insertion per block; (size, order) are unique, so no block is compared

