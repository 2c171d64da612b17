"""Layouts as the harness sees them: every reachable layout, by branch.

The derivation of the require_* flags is the engine's and lives with the system under
test (runners.parallel.layout); this module enumerates layouts so tests and strategies
can cover every branch, and builds the sibling layouts the branch-parity check needs.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Optional

from runners.config import DEFAULT_MODEL, ModelConfig
from runners.model import check_model_fits_layout
from runners.parallel.layout import Branch, LayoutError, ParallelLayout

__all__ = ["ParallelLayout", "Branch", "LayoutError", "all_layouts", "layouts_by_branch", "branch_sibling"]


@lru_cache(maxsize=None)
def all_layouts(max_world: int = 8, model: ModelConfig = DEFAULT_MODEL) -> tuple[ParallelLayout, ...]:
    """Every valid layout with tp in {1, 2, 4, 8} (<= max_world) that the model can be sharded over."""
    out = []
    for tp in (1, 2, 4, 8):
        if tp > max_world:
            continue
        for dp in [d for d in (1, 2, 4, 8) if d <= tp and tp % d == 0]:
            for dp_attn in ((False,) if dp == 1 else (True,)):
                for dense in (None, 1):
                    for lm_head in ((False, True) if dp_attn else (False,)):
                        for a2a in ("none", "deepep"):
                            try:
                                layout = ParallelLayout(tp, dp, dp_attn, dense, lm_head, a2a)
                                check_model_fits_layout(model, layout)
                            except LayoutError:
                                continue
                            out.append(layout)
    return tuple(dict.fromkeys(out))


def layouts_by_branch(max_world: int = 8) -> dict[Branch, list[ParallelLayout]]:
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
