"""Mutants of tree verification (runners.verify, the verify batch in runners.target, the
TARGET_VERIFY runner's mask fill and the loop's KV move in runners.spec_decode).

Each is killed on CPU by the property named in its entry: P5 (spec-cases: committed tokens
against target-only greedy, on the tree case tp2_page4_tree, whose rounds accept siblings),
P2 (padded-lanes: the verify runner's canonical fill, on the same case, whose batch
shrinks over buckets) or P1 (metadata-grid: the verify runner's buckets against the engine's
token-aligned rule, on the attn-TP layouts). Functions the runners import by name are patched
where they are used.
"""
from __future__ import annotations

from typing import Sequence

import torch

from harness.mutants.base import Mutant, keeps
from runners import decode_cuda_graph_runner, spec_decode, target
from runners.batch import ForwardBatch
from runners.decode_cuda_graph_runner import DecodeCudaGraphRunner

_REAL_FILL = DecodeCudaGraphRunner._fill_padded_lanes
_REAL_CAPTURE_BS = decode_cuda_graph_runner.compute_capture_bs


def _mask_sees_siblings(parents: Sequence[int]) -> torch.Tensor:
    return torch.ones(len(parents), len(parents), dtype=torch.bool).tril()  # every earlier node, not only the ancestors


def _sibling_at_parent_depth(parents: Sequence[int]) -> list[int]:
    depth: list[int] = []
    for i, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + (p == i - 1))  # a node off its parent's next slot keeps the parent's depth
    return depth


def _no_kv_moves(path: Sequence[int]) -> list[tuple[int, int]]:
    return []  # accepted nodes' KV stays in their node slots; the chain slot keeps the rejected node's


def _node_slot_by_position(fb: ForwardBatch, token_to_req: torch.Tensor) -> torch.Tensor:
    return fb.positions  # a node's KV at its depth's column: siblings overwrite each other and the chain node there


def _request_aligned_buckets(layout, configured, max_running_requests, tokens_per_bs=1) -> list[int]:
    return _REAL_CAPTURE_BS(layout, configured, max_running_requests)  # the draft runners' rule: bs itself a multiple of the base


def _unaligned_buckets(layout, configured, max_running_requests, tokens_per_bs=1) -> list[int]:
    return _REAL_CAPTURE_BS(layout, configured, max_running_requests, layout.capture_bs_base)  # every bs * base splits: no bucket dropped


MUTANTS: list[Mutant] = [
    Mutant(
        "verify-tree-mask-sees-siblings",
        "the verify tree mask is lower-triangular over the lane's nodes: a node attends every earlier node, its "
        "siblings and their subtrees included, not only its ancestors (right for a chain, wrong for a tree)",
        "verify tree mask",
        ((target, "tree_mask", _mask_sees_siblings), (decode_cuda_graph_runner, "tree_mask", _mask_sees_siblings)),
        ("spec-cases:tp2_page4_tree", "spec-cases"),  # P5: the bonus after an accepted sibling is computed over a wrong context
    ),
    Mutant(
        "verify-tree-sibling-position-off-by-one",
        "tree positions: a node that is not its parent's first child in lane order gets its parent's depth, one less "
        "than its own, so a top-k sibling is rotated as its parent's position",
        "tree positions off by one",
        ((target, "tree_depths", _sibling_at_parent_depth),),
        ("spec-cases:tp2_page4_tree", "spec-cases"),  # P5: the bonus after an accepted sibling
    ),
    Mutant(
        "verify-accepted-kv-not-moved",
        "after a tree verify the accepted nodes' target KV is not moved from their node slots (root + index) to their "
        "chain slots (root + depth): the next round attends the rejected top-1 node's KV at that position",
        "accepted KV not moved",
        ((spec_decode, "kv_moves", _no_kv_moves),),
        ("spec-cases:tp2_page4_tree", "spec-cases"),  # P5: tokens after an accepted sibling
    ),
    Mutant(
        "verify-node-kv-at-position",
        "a tree node's KV write slot is looked up at its position (root + depth) instead of its node column (root + "
        "index): nodes of one depth write one slot, so a node's descendants attend another node's KV",
        "verify node slot",
        ((target, "cache_positions", _node_slot_by_position),),
        ("spec-cases:tp2_page4_tree", "spec-cases"),  # P5
    ),
    Mutant(
        "verify-stale-padded-mask",
        "TARGET_VERIFY replay fill leaves the padded lanes' tree masks alone: after the batch shrinks they keep the "
        "larger batch's trees instead of the canonical chain mask",
        "stale padded lane after shrink",
        ((DecodeCudaGraphRunner, "_fill_padded_lanes", keeps(_REAL_FILL, "custom_mask")),),
        ("padded-lanes:tp2_page4_tree", "padded-lanes"),  # P2 (canonical fill): harmless to real rows, every tree mask lets a node see its root
    ),
    Mutant(
        "verify-buckets-request-aligned",
        "the TARGET_VERIFY runner keeps the draft runners' buckets (bs a multiple of attn_tp_size) instead of the "
        "engine's (bs * T a multiple): on tp8 attn-TP gather with T = 4 it drops buckets 2 and 4 and a batch of 1 "
        "replays at 8",
        "verify buckets",
        ((decode_cuda_graph_runner, "compute_capture_bs", _request_aligned_buckets),),
        ("metadata-grid:chains-tp2", "metadata-grid"),  # P1 (capture_bs, smallest bucket): only the buckets change, the metadata of each stays right
    ),
    Mutant(
        "verify-bucket-tokens-unsplit",
        "the TARGET_VERIFY runner keeps every configured bucket that fits the pool, also those whose bs * T tokens do "
        "not split over the attn-TP ranks (tp8 attn-TP gather, T = 4: bucket 1, 4 tokens over 8 ranks)",
        "verify buckets",
        ((decode_cuda_graph_runner, "compute_capture_bs", _unaligned_buckets),),
        ("metadata-grid:trees-tp2", "metadata-grid"),  # P1 (capture_bs, bs * T % attn_tp_size)
    ),
]
