"""Mutants of the padding rule: the replay fill resets padded lanes only when the replayed bucket is larger
than the batch (the single-layer draft-extend, draft-decode and target-verify runners, as the engine's).

Each judges padding by the rank's own batch (the bucket it alone would need) instead of the bucket it
replays: in the MLP-TP gather branch every DP group replays the bucket of the largest group, so a rank whose
own batch is a captured bucket skips the fill while the graph reads lanes past it. Killed by P1 (the padded
seq_lens the baked metadata counts) on the DP metadata grid.
"""
from __future__ import annotations

from typing import Any, Callable

from harness.mutants.base import Mutant, Wrap
from runners.decode_cuda_graph_runner import DecodeCudaGraphRunner
from runners.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
from runners.eagle_draft_extend_cuda_graph_runner import EAGLEDraftExtendCudaGraphRunner

_KIND = "padding judged by the rank's own batch"


def _own_bucket_by_requests(real: Callable[..., Any]) -> Callable[..., Any]:
    def fill(self: Any, raw_bs: int, bs: int) -> None:
        real(self, raw_bs, self._choose_bucket(raw_bs))

    return fill


def _own_bucket_by_tokens(real: Callable[..., Any]) -> Callable[..., Any]:
    def fill(self: Any, num_tokens: int, bs: int) -> None:
        real(self, num_tokens, self._choose_bucket(num_tokens // self.T))

    return fill


MUTANTS: tuple[Mutant, ...] = tuple(
    Mutant(
        f"{name}-padding-judged-by-own-batch",
        f"the {what} replay fill compares the batch with the bucket its own batch needs, not the bucket every DP group "
        "replays: with a larger peer batch the padded lanes keep a larger batch's lengths and request rows",
        _KIND,
        ((runner, "_fill_padded_lanes", Wrap(wrap)),),
        ("metadata-dp",),  # P1 (padded seq_lens)
    )
    for name, what, runner, wrap in (
        ("single-layer", "single-layer draft-extend", EAGLEDraftExtendCudaGraphRunner, _own_bucket_by_tokens),
        ("decode", "draft-decode", EAGLEDraftCudaGraphRunner, _own_bucket_by_requests),
        ("verify", "target-verify", DecodeCudaGraphRunner, _own_bucket_by_requests),
    )
)
