"""Tree verification of a draft's proposals: the verify tree, its mask and positions, greedy acceptance.

A request's verify lane holds num_draft_tokens = T tokens: node 0 is the root (the last
committed token x) and nodes 1..T-1 are draft tokens, each with a parent of lower index, so
a lane is a tree laid out as the engine lays out its draft tree (`build_tree_kernel_efficient`):

* position of node i = position of the root + depth(i) (siblings share a position);
* KV of node i goes to the request's cache slot at root position + i (every node its own
  slot, whatever its depth), looked up through the request's req_to_token row;
* node i attends the prefix and the cache slots of its ancestors and itself: the tree mask
  [T, T] (mask[i, j] = j is i or an ancestor of i). A chain (parent of i is i - 1) gives a
  lower-triangular mask and positions root + i, the plain causal verify.

Acceptance is greedy: from the root, while some child of the current node carries the
target's argmax after the current node, accept that child and move to it; commit the
argmax after each accepted node (the accepted drafts and the bonus). Committed tokens are
target argmaxes, so the output is the target's greedy output whatever the draft proposes
(P5); only the accept lengths depend on the draft (P6). The accepted nodes' KV then moves
to their chain positions (root position + depth), as the engine moves it after a tree verify.

The draft gives a `DraftTree` per request: its T - 1 draft tokens with parent indices (-1:
the root). The multi-layer draft's `Proposal` (the top-1 chain and every depth's top-k, whose
siblings have no children) becomes one by `tree_of`: the chain first, then the siblings by
depth, cut to T - 1 nodes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch

from runners.scheduler import Proposal


@dataclass(frozen=True)
class DraftTree:
    """The draft tokens of one request below the root; parents[i] < i, -1 is the root."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    top1: tuple[bool, ...] = ()  # per node: on the draft's top-1 chain (a node off it is a sibling)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or any(not -1 <= p < i for i, p in enumerate(self.parents)):
            raise ValueError(f"a draft tree needs one parent per token, each earlier in the list or -1: {self.parents}")

    def lane(self, root_token: int) -> tuple[list[int], list[int]]:
        """The verify lane's tokens and parents (node 0 the root, parent -1)."""
        return [root_token, *self.tokens], [-1, *(p + 1 for p in self.parents)]


def tree_of(proposal: Union[Proposal, DraftTree], num_nodes: int, siblings: bool = True) -> DraftTree:
    """A draft's proposal as a tree of `num_nodes` draft tokens: the chain d_1..d_S, then each depth's
    siblings (children of the chain node one level up); cut to num_nodes (siblings=False: the chain only)."""
    if isinstance(proposal, DraftTree):
        return DraftTree(proposal.tokens[:num_nodes], proposal.parents[:num_nodes], proposal.top1[:num_nodes])
    S = len(proposal.tokens)
    tokens, parents = list(proposal.tokens), list(range(-1, S - 1))
    if siblings:
        for k, cands in enumerate(proposal.candidates):
            for t in cands[1:]:
                tokens.append(int(t))
                parents.append(k - 1)  # depth k + 1: a child of d_k (the root for k = 0)
    n = min(num_nodes, len(tokens))
    return DraftTree(tuple(tokens[:n]), tuple(parents[:n]), tuple(i < S for i in range(n)))


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node of a lane (the root 0)."""
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def tree_mask(parents: Sequence[int]) -> torch.Tensor:
    """[T, T] bool: mask[i, j] = node j is node i or one of its ancestors."""
    T = len(parents)
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def chain_mask(T: int) -> torch.Tensor:
    """The mask of a chain of T nodes: the canonical mask of a padded lane (every node sees the root)."""
    return torch.ones(T, T, dtype=torch.bool).tril()


def accept_path(parents: Sequence[int], tokens: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """The greedy walk: node indices accepted from the root (the root first)."""
    path = [0]
    while True:
        cur = path[-1]
        nxt = next((i for i, p in enumerate(parents) if p == cur and tokens[i] == argmax[cur]), None)
        if nxt is None:
            return path
        path.append(nxt)


@dataclass
class Acceptance:
    accept_len: int  # committed tokens this round: accepted drafts + the bonus, 1..depth + 1
    new_tokens: list[int]  # the target's argmax after each accepted node
    path: list[int]  # lane node indices of the root and the accepted drafts, in depth order
    off_chain: bool = False  # an accepted draft was off the draft's top-1 chain (a top-k sibling)


def accept(tokens: Sequence[Sequence[int]], parents: Sequence[Sequence[int]], argmax: torch.Tensor,
           top1: Sequence[Sequence[bool]] = ()) -> list[Acceptance]:
    """Greedy acceptance per request lane; argmax[b, i] is the target's argmax after node i of lane b."""
    g = argmax.to(torch.int64).cpu().tolist()
    out = []
    for b, (tok, par) in enumerate(zip(tokens, parents, strict=True)):
        path = accept_path(par, tok, g[b])
        chain = top1[b] if b < len(top1) else ()
        off = any(i - 1 < len(chain) and not chain[i - 1] for i in path[1:])
        out.append(Acceptance(len(path), [g[b][i] for i in path], path, off))
    return out


def kv_moves(path: Sequence[int]) -> list[tuple[int, int]]:
    """(from node, to depth) for every accepted node not already at its chain position. Node index
    >= depth always (its ancestors come first), so moving in depth order never overwrites a source."""
    return [(i, d) for d, i in enumerate(path) if i != d]
