"""Mutants of the overlap scheduler (runners.overlap): the future map's ring and its placeholders. The overlap case's
probe kills them (P5: the committed tokens are no longer target greedy's; P6)."""
from __future__ import annotations

import torch

from harness.mutants.base import Mutant
from runners.overlap import FutureIndices, FutureMap, OverlapScheduler


def _alloc_ring_of_one_iteration(self: FutureMap, bs: int) -> FutureIndices:
    """alloc_future_indices over a ring of max_running_requests slots, one launch's worth: two launches in a row may
    share slots, so a launch stores over the results of the one before it before the host has read them."""
    start = self.future_ct + 1
    self.future_ct = (self.future_ct + bs) % (self.future_limit // 3)
    return FutureIndices(torch.arange(start, start + bs, device=self.lane_tokens.device), slice(start, start + bs))


def _resolve_slot_before(self: FutureMap, input_ids: torch.Tensor) -> torch.Tensor:
    """resolve_future decoding a placeholder -slot as slot - 1 (the allocation starts at ct + 1, the decoding at ct)."""
    T = self.lane_tokens.shape[1]
    col = torch.arange(input_ids.shape[0], device=input_ids.device) % T
    return torch.where(input_ids < 0, self.lane_tokens[(-input_ids - 1).clamp(min=0), col], input_ids)


def _trim_as_synchronous(self: OverlapScheduler, r) -> int:
    return len(r.tokens) - 1  # the loop without overlap keeps its verified positions only: here the next launch's are freed


def _reserve_as_synchronous(self: OverlapScheduler, r) -> int:
    return len(r.tokens) - 1 + self.engine.T  # the next verify's positions as if the unread launch had accepted nothing


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "overlap-future-slot-reused-early",
        "the future map's ring holds one iteration (max_running_requests slots, not three times that): a launch is handed "
        "slots the launch before it still holds, and stores over its results before the host processes them",
        "buffer reused one iteration too early",
        ((FutureMap, "alloc_future_indices", _alloc_ring_of_one_iteration),),
        ("overlap-case",),  # P5: the host commits the later launch's verified tokens for the earlier one
    ),
    Mutant(
        "overlap-placeholder-wrong-slot",
        "a placeholder -slot is resolved against slot - 1: the lane's bonus token and drafts are another request's (or "
        "stale), so it verifies from the wrong last token",
        "placeholder resolved against the wrong slot",
        ((FutureMap, "resolve_future", _resolve_slot_before),),
        ("overlap-case",),  # P5, P6
    ),
    Mutant(
        "overlap-pages-freed-an-iteration-early",
        "reading a launch, the host trims a request's pages to its committed tokens as the synchronous loop does: the "
        "pages of the launch after it, already run, go back to the allocator with the KV of the tokens it accepted",
        "buffer reused one iteration too early",
        ((OverlapScheduler, "kept_positions", _trim_as_synchronous),),
        ("overlap-case",),  # P5: another request overwrites the freed KV
    ),
    Mutant(
        "overlap-reserve-without-the-unread-launch",
        "a request whose last launch is unread reserves pages for one verify past the length the host knows, as if that "
        "launch accepted nothing: the next launch verifies past its pages, into slots its row does not hold",
        "buffer sized without the iteration in flight",
        ((OverlapScheduler, "reserved_positions", _reserve_as_synchronous),),
        ("overlap-case",),  # P5
    ),
)
