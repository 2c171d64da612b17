"""Mutants of the fused multi-layer draft-extend prepare fill (runners.draft_extend_fill), run on CPU.

The fused fill is the CUDA path; a CPU runner takes the torch twin. Each mutant here therefore pins the
fused path (Triton's interpreter runs it on CPU) and gives the kernel a wrong padding value, the kind of
break a hand-written fill kernel has: padded lanes on a live request's row, or a wrong seq-len fill.
"""
from __future__ import annotations

import torch

from harness.mutants.base import Mutant, Wrap
from runners.memory import LanePadding
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import PrepareFill


def _always_fused(cls: type[PrepareFill], device: torch.device | str) -> PrepareFill:
    return cls.TRITON


_FUSED = (PrepareFill, "for_device", classmethod(_always_fused))
_FILL = "runners.draft_extend_fill"  # imports triton, an optional package: named here, imported when a mutant is planted


def _padded_rows_on_row_one(real):
    """The launcher handing the kernel request row 1 as the padding row (the slot value kept)."""
    return lambda buffers, inp, bs, tokens_per_bs, pad: real(buffers, inp, bs, tokens_per_bs, LanePadding(1, pad.slot))

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "fused-fill-padded-rows-live",
        "the fused prepare fill gives padded lanes request row 1 instead of the padding row: their in-graph KV slot "
        "lookup goes through a live request's row and writes into its slots",
        "KV write for padded rows lands in a live slot",
        (_FUSED, (_FILL, "fill_prepare_buffers", Wrap(_padded_rows_on_row_one))),
        ("padded-lanes-multi-layer",),  # P2 (canonical out_cache_loc: the slot lookup)
    ),
    Mutant(
        "fused-fill-seq-len-fill-off",
        "the fused prepare fill writes 2 into the padded lanes' seq_lens instead of the fill value the capture baked "
        "into seq_lens_sum",
        "stale padded lane after shrink",
        (_FUSED, (_FILL, "SEQ_LEN_FILL_VALUE", 2)),
        ("metadata-dp",),  # P1 (padded seq_lens)
    ),
)
