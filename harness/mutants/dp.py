"""Mutants of the eager MLP-sync padding's two guards (runners.mlp_sync): when a batch is padded at
all, and in what lanes a verify batch is padded."""
from __future__ import annotations

from harness.mutants.base import Mutant
from runners import mlp_sync


def _pads_without_gathered_counts(layout, fb) -> bool:
    return layout.require_mlp_sync and layout.attn_dp_size > 1  # pads the "neither" branch too, which gathers nothing


def _verify_pads_token_lanes(fb, lane_len):
    return lane_len  # a verify batch padded as an EXTEND one: one lane of the missing tokens, not whole trees


MUTANTS: list[Mutant] = [
    Mutant(
        "dp-pad-without-gathered-counts",
        "eager MLP-sync pads every DP rank's batch under DP attention, also when the batch carries no "
        "global_num_tokens_cpu (the neither branch): the padded rows reach lm_head",
        "padding where the engine does not pad",
        ((mlp_sync, "needs_dp_padding", _pads_without_gathered_counts),),
        ("cases:tp4_dp4_neither", "cases"),
    ),
    Mutant(
        "dp-verify-pad-token-lanes",
        "eager MLP-sync pads a DP verify batch with one lane of the missing tokens instead of whole trees of "
        "draft_token_num nodes: the padded lane has no tree mask of its shape",
        "verify padding in the wrong lanes",
        ((mlp_sync, "padded_lane_len", _verify_pads_token_lanes),),
        ("spec-cases:tp2_dp2_mlp_tp_gather-eager", "spec-cases"),
    ),
]
