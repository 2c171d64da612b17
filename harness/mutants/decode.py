"""Mutants of the single-layer EAGLE draft decode (runners.eagle_draft, runners.eagle_draft_cuda_graph_runner).

Each is one deviation from the real code, killed on CPU by the draft-decode probe
(harness.props.draft_decode.probe_draft_decode): P1 for metadata and fill values it records, P2 where a
poisoned padded lane is read or writes live KV, P3 where
the graph diverges from the eager reference, P6 where the step body itself (shared by both) is
wrong and only the accept lengths can tell.
"""
from __future__ import annotations

import torch

from harness.mutants.base import Mutant, keeps
from runners import eagle_draft
from runners.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner

_REAL_SELECT = eagle_draft.select_top_k_tokens


def _positions_not_advanced(positions: torch.Tensor) -> None:
    pass  # every draft step's tokens read the rotary row (and sit at the position) of the first


def _parent_off_by_one(i, topk_p, topk_index, hidden, scores, topk):
    ids, h, s, parents = _REAL_SELECT(i, topk_p, topk_index, hidden, scores, topk)
    if i == 0:
        return ids, h, s, parents
    wrong = (parents + 1) % topk  # each new node is fed its neighbour lane's hidden state, not its parent's
    lane = (wrong + torch.arange(parents.shape[0], device=parents.device)[:, None] * topk).reshape(-1)
    return ids, hidden[lane], s, parents


def _capture_counts_requests(self: EAGLEDraftCudaGraphRunner, bs: int) -> int:
    return bs  # DECODE has bs * topk lanes, each given logits; the same number only at topk 1


MUTANTS: list[Mutant] = [
    Mutant(
        "decode-fill-req-pool-indices",
        "draft decode replay fill keeps the padded lanes' stale request rows: the in-graph slot lookup writes their KV into a live request's prefix",
        "replay fill",
        ((EAGLEDraftCudaGraphRunner, "_fill_padded_lanes", keeps(EAGLEDraftCudaGraphRunner._fill_padded_lanes, "req_pool_indices")),),
        probes=("draft-decode:padded-lanes", "draft-decode"),  # P2 (live KV moved), P3 (eager vs graph after a shrink), P6
    ),
    Mutant(
        "decode-fill-seq-lens",
        "draft decode replay fill keeps the padded lanes' stale seq_lens",
        "replay fill",
        ((EAGLEDraftCudaGraphRunner, "_fill_padded_lanes", keeps(EAGLEDraftCudaGraphRunner._fill_padded_lanes, "seq_lens")),),
        probes=("draft-decode:tp1_planned_single_layer", "draft-decode"),  # P1 padded seq_lens = fill, seq_lens_sum
    ),
    Mutant(
        "decode-fill-positions",
        "draft decode replay fill keeps the padded lanes' stale positions: the in-graph rotary gather reads past its table",
        "replay fill",
        ((EAGLEDraftCudaGraphRunner, "_fill_padded_lanes", keeps(EAGLEDraftCudaGraphRunner._fill_padded_lanes, "positions")),),
        probes=("draft-decode:padded-lanes", "draft-decode"),  # P2 (poisoned positions)
    ),
    Mutant(
        "decode-fill-topk-index",
        "draft decode replay fill keeps the padded lanes' stale top-k token ids: the embedding gather reads past the vocab",
        "replay fill",
        ((EAGLEDraftCudaGraphRunner, "_fill_padded_lanes", keeps(EAGLEDraftCudaGraphRunner._fill_padded_lanes, "topk_index")),),
        probes=("draft-decode:padded-lanes", "draft-decode"),  # P2 (poisoned token ids)
    ),
    Mutant(
        "decode-positions-not-advanced",
        "the draft decode body never advances the lanes' positions between steps (in graph and eager alike)",
        "in-graph position advance",
        ((eagle_draft, "advance_positions", _positions_not_advanced),),
        probes=("draft-decode:tp1_planned_single_layer", "draft-decode"),  # P6 (the draft-tree golden)
    ),
    Mutant(
        "decode-tree-parent-off-by-one",
        "tree expansion feeds each kept node the hidden state of its parent's neighbour lane (parent index off by one)",
        "tree expansion",
        ((eagle_draft, "select_top_k_tokens", _parent_off_by_one),),
        probes=("draft-decode:tp2_dp2_eagle3", "draft-decode"),  # P6 (the draft-tree golden of the topk 2 case)
    ),
    Mutant(
        "decode-capture-counts-requests",
        "draft decode get_forward_batch bakes bs (requests) where DECODE has bs * topk tokens; the replay fill writes bs * topk",
        "capture metadata",
        ((EAGLEDraftCudaGraphRunner, "_capture_num_tokens", _capture_counts_requests),),
        probes=("draft-decode:metadata", "draft-decode"),  # P1 I1 / I5 at topk 2 in the gathered branches
    ),
]
