"""Mutants of the single-layer draft decode's attention on the triton backend (runners.attention.triton_backend).

The draft decode attends with the case's backend; each mutant makes the triton draft-decode kernel read
another set of keys than the engine's multi-step draft backends do (the prefix below seq_len, then the
lane's own draft slots of steps 0..s). Eager and graph run the same kernel, so P3 cannot see them: the
draft-decode-backends probe (harness.decode_props.probe_draft_decode_backends) compares the triton tree
with the torch reference's on the same inputs (P4, the reference as oracle).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from harness.mutants.base import Mutant
from runners.attention.triton_backend import TritonAttnBackend, TritonDraftDecodeMetadata

_REAL_META = TritonAttnBackend.init_draft_decode_metadata
_REAL_FORWARD = TritonAttnBackend.forward


def _one_slot_short(self: TritonAttnBackend, fb, locs: torch.Tensor, step: int) -> TritonDraftDecodeMetadata:
    meta = _REAL_META(self, fb, locs, step)
    return replace(meta, num_draft=step)  # steps 0..step-1: at step 0 a lane does not see its own token


def _other_lane_slots(self: TritonAttnBackend, fb, locs: torch.Tensor, step: int) -> TritonDraftDecodeMetadata:
    meta = _REAL_META(self, fb, locs, step)
    return replace(meta, locs=meta.locs.roll(1, dims=0))  # lane i reads lane i - 1's draft column


def _keys_past_seq_len(self: TritonAttnBackend, layer, q, k, v, fb, meta):
    if isinstance(meta, TritonDraftDecodeMetadata):  # the prefix bound at the end of the request's row, not seq_len
        fb = replace(fb, seq_lens=torch.full_like(fb.seq_lens, self.req_pool.req_to_token.shape[1]))
    return _REAL_FORWARD(self, layer, q, k, v, fb, meta)


MUTANTS: list[Mutant] = [
    Mutant(
        "decode-triton-draft-slot-short",
        "the triton draft-decode kernel reads one draft slot too few (steps 0..s-1): a lane never attends its newest token",
        "draft-decode attention",
        ((TritonAttnBackend, "init_draft_decode_metadata", _one_slot_short),),
        probes=("draft-decode-backends",),  # P4 (triton vs the torch reference)
    ),
    Mutant(
        "decode-triton-other-lane-slots",
        "the triton draft-decode kernel reads its neighbour lane's draft slots instead of its own",
        "draft-decode attention",
        ((TritonAttnBackend, "init_draft_decode_metadata", _other_lane_slots),),
        probes=("draft-decode-backends",),  # P4
    ),
    Mutant(
        "decode-triton-ignores-seq-len",
        "the triton draft-decode kernel reads the request's whole req_to_token row, keys past seq_len included",
        "draft-decode attention",
        ((TritonAttnBackend, "forward", _keys_past_seq_len),),
        probes=("draft-decode-backends",),  # P4
    ),
]
