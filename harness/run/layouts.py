"""Layouts as the harness sees them: every reachable layout, by branch.

The derivation of the require_* flags is the engine's and lives with the system under
test (runners.parallel.layout); this module enumerates layouts so tests and strategies
can cover every branch, and builds the sibling layouts the branch-parity check needs.

Two sets: `all_layouts()` (tp 1..8, one node) is the grid every mutant run walks;
`deployed_layouts()` adds the multi-node DP-attention worlds (tp 16/32/64), which only
the model's shardability bounds (attn_tp_size must divide the heads, tp the vocab and
the MLP), so they exist only with enough DP groups.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Optional

from runners.config import DEFAULT_MODEL, ModelConfig
from runners.model import check_model_fits_layout
from runners.parallel.layout import Branch, LayoutError, ParallelLayout

__all__ = [
    "ParallelLayout", "Branch", "LayoutError", "all_layouts", "deployed_layouts", "layouts_by_branch", "branch_sibling", "DEPLOYED_WORLDS",
]

SINGLE_NODE_WORLD = 8
DEPLOYED_WORLDS = (16, 32, 64)  # DP-attention deployments over 2, 4 and 8 nodes of 8 GPUs


def _powers_of_two(upto: int) -> list[int]:
    return [1 << i for i in range(upto.bit_length()) if 1 << i <= upto]


def _layouts_at(tp: int, model: ModelConfig) -> list[ParallelLayout]:
    """Every flag combination at one world size that is a valid layout the model fits."""
    out = []
    for dp in [d for d in _powers_of_two(tp) if tp % d == 0]:
        dp_attn = dp > 1
        for dense in (None, 1):
            for lm_head in ((False, True) if dp_attn else (False,)):
                for a2a in ("none", "deepep"):
                    try:
                        layout = ParallelLayout(tp, dp, dp_attn, dense, lm_head, a2a)
                        check_model_fits_layout(model, layout)
                    except LayoutError:
                        continue
                    out.append(layout)
    return out


@lru_cache(maxsize=None)
def all_layouts(max_world: int = SINGLE_NODE_WORLD, model: ModelConfig = DEFAULT_MODEL) -> tuple[ParallelLayout, ...]:
    """Every valid layout with tp a power of two <= max_world that the model can be sharded over."""
    return tuple(dict.fromkeys(layout for tp in _powers_of_two(max_world) for layout in _layouts_at(tp, model)))


@lru_cache(maxsize=None)
def deployed_layouts(model: ModelConfig = DEFAULT_MODEL) -> tuple[ParallelLayout, ...]:
    """Every valid layout at the multi-node world sizes (DEPLOYED_WORLDS)."""
    return tuple(dict.fromkeys(layout for tp in DEPLOYED_WORLDS for layout in _layouts_at(tp, model)))


def layouts_by_branch(max_world: int = SINGLE_NODE_WORLD) -> dict[Branch, list[ParallelLayout]]:
    groups: dict[Branch, list[ParallelLayout]] = {b: [] for b in Branch}
    for layout in all_layouts(max_world):
        groups[layout.branch].append(layout)
    return groups


def branch_sibling(layout: ParallelLayout) -> Optional[ParallelLayout]:
    """The same tp/dp in the other gathered branch (MLP <-> attn), for branch parity (I3)."""
    if layout.branch is Branch.MLP_TP_GATHER and layout.dp_size < layout.tp_size:
        cand = replace(layout, moe_dense_tp_size=1, enable_dp_lm_head=True, moe_a2a_backend="deepep")
    elif layout.branch is Branch.ATTN_TP_GATHER and layout.enable_dp_attention:
        cand = replace(layout, moe_dense_tp_size=None, enable_dp_lm_head=False, moe_a2a_backend="none")
    else:
        return None
    return cand if cand.branch is not layout.branch and cand.branch is not Branch.NEITHER else None
