"""Mutants of the single-layer draft decode's attention on the triton backend (runners.attention.triton_backend).

The draft decode attends with the case's backend; each mutant makes the triton draft-decode kernel read
another set of keys than the engine's multi-step draft backends do (the prefix below seq_len, then the
lane's own draft slots of steps 0..s). Eager and graph run the same kernel, so P3 cannot see them: the
draft-decode-backends probe (harness.props.p4) compares the triton tree
with the torch reference's on the same inputs (P4, the reference as oracle).
"""
from __future__ import annotations

import importlib
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

import torch

from harness.mutants.base import Mutant, Wrap

if TYPE_CHECKING:
    from runners.attention.triton_backend import TritonAttnBackend, TritonDraftDecodeMetadata

# triton_backend imports triton, an optional package: the catalog names it, and planting a mutant imports it
_BACKEND = "runners.attention.triton_backend"
_CLASS = f"{_BACKEND}:TritonAttnBackend"
_Meta = Callable[["TritonAttnBackend", Any, torch.Tensor, int], "TritonDraftDecodeMetadata"]


def _one_slot_short(real: _Meta) -> _Meta:
    def init_draft_decode_metadata(self: TritonAttnBackend, fb, locs: torch.Tensor, step: int) -> TritonDraftDecodeMetadata:
        return replace(real(self, fb, locs, step), num_draft=step)  # steps 0..step-1: at step 0 a lane does not see its own token

    return init_draft_decode_metadata


def _other_lane_slots(real: _Meta) -> _Meta:
    def init_draft_decode_metadata(self: TritonAttnBackend, fb, locs: torch.Tensor, step: int) -> TritonDraftDecodeMetadata:
        meta = real(self, fb, locs, step)
        return replace(meta, locs=meta.locs.roll(1, dims=0))  # lane i reads lane i - 1's draft column

    return init_draft_decode_metadata


def _keys_past_seq_len(real: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    draft_meta = importlib.import_module(_BACKEND).TritonDraftDecodeMetadata

    def forward(self: TritonAttnBackend, layer, q, k, v, fb, meta) -> torch.Tensor:
        if isinstance(meta, draft_meta):  # the prefix bound at the end of the request's row, not seq_len
            fb = replace(fb, seq_lens=torch.full_like(fb.seq_lens, self.req_pool.req_to_token.shape[1]))
        return real(self, layer, q, k, v, fb, meta)

    return forward


MUTANTS: list[Mutant] = [
    Mutant(
        "decode-triton-draft-slot-short",
        "the triton draft-decode kernel reads one draft slot too few (steps 0..s-1): a lane never attends its newest token",
        "draft-decode attention",
        ((_CLASS, "init_draft_decode_metadata", Wrap(_one_slot_short)),),
        probes=("draft-decode-backends",),  # P4 (triton vs the torch reference)
    ),
    Mutant(
        "decode-triton-other-lane-slots",
        "the triton draft-decode kernel reads its neighbour lane's draft slots instead of its own",
        "draft-decode attention",
        ((_CLASS, "init_draft_decode_metadata", Wrap(_other_lane_slots)),),
        probes=("draft-decode-backends",),  # P4
    ),
    Mutant(
        "decode-triton-ignores-seq-len",
        "the triton draft-decode kernel reads the request's whole req_to_token row, keys past seq_len included",
        "draft-decode attention",
        ((_CLASS, "forward", Wrap(_keys_past_seq_len)),),
        probes=("draft-decode-backends",),  # P4
    ),
]
