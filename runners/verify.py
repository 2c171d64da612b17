"""Greedy verification of a draft's proposals: accept lengths, the bonus token, tree siblings.

The multi-layer draft feeds each next step the top-1 token of the previous one, so with
topk = k it proposes a "caterpillar" tree: the top-1 chain d_1..d_S, and at every depth
k-1 siblings of d_k that share d_k's parent. Verification is greedy: the target's argmax g
after each accepted prefix.

* chain: accept d_1..d_c while d_j == g_{j-1}; commit g_0..g_c (c accepted drafts + the
  bonus g_c): accept length c + 1.
* tree: if the chain stops at depth c + 1 < S + 1 and a sibling there equals g_c, accept
  it too, with the target's argmax after it as the bonus: accept length c + 2 (<= S + 1).
  Siblings have no children, so this is the whole tree.

Either way the committed tokens are target argmaxes, so the output is the target's greedy
output whatever the draft proposes (P5); only the accept lengths depend on the draft (P6).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from runners.scheduler import Proposal


@dataclass(frozen=True)
class SiblingNode:
    lane: int  # the request's row in the batch
    depth: int  # 1..S
    j: int  # index in that depth's top-k (>= 1)
    token: int


@dataclass
class Acceptance:
    accept_len: int  # committed tokens this round: accepted drafts + the bonus, 1..S+1
    new_tokens: list[int]
    sibling: Optional[SiblingNode] = None  # set when the last accepted draft is a sibling


def siblings(proposals: list[Proposal]) -> list[SiblingNode]:
    out = []
    for lane, p in enumerate(proposals):
        for k, cands in enumerate(p.candidates):
            out.extend(SiblingNode(lane, k + 1, j, int(t)) for j, t in enumerate(cands) if j > 0)
    return out


def chain_accept_lens(drafts: torch.Tensor, target_argmax: torch.Tensor) -> torch.Tensor:
    """drafts [bs, S], target_argmax [bs, S+1] (the argmax after x, d_1, ..., d_S): 1 + the leading matches."""
    match = (drafts == target_argmax[:, :-1]).to(torch.int64)
    return match.cumprod(dim=1).sum(dim=1) + 1


def accept(
    proposals: list[Proposal],
    target_argmax: torch.Tensor,
    sibling_nodes: list[SiblingNode] = (),
    sibling_argmax: Optional[torch.Tensor] = None,
) -> list[Acceptance]:
    """Greedy acceptance per request; `sibling_argmax[i]` is the target's argmax after sibling_nodes[i]."""
    if not proposals:
        return []
    drafts = torch.tensor([p.tokens for p in proposals], dtype=torch.int64).reshape(len(proposals), -1)
    g = target_argmax.to(torch.int64).cpu()
    lens = chain_accept_lens(drafts, g).tolist()
    by_node = {(n.lane, n.depth, n.token): (n, i) for i, n in enumerate(sibling_nodes)}
    S = drafts.shape[1]
    out = []
    for lane, a in enumerate(lens):
        c = a - 1  # accepted chain drafts
        new = g[lane, : c + 1].tolist()
        hit = by_node.get((lane, c + 1, new[-1])) if c < S else None
        if hit is not None:  # the bonus g_c is a sibling at depth c + 1: accept it, bonus after it
            node, i = hit
            out.append(Acceptance(a + 1, new + [int(sibling_argmax[i])], node))
        else:
            out.append(Acceptance(a, new))
    return out
