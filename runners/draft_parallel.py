"""The draft's own tensor-parallel placement (SpecConfig.draft_tp_size), and the hand-off of its proposals.

The engines let the draft run with a TP size of its own: vLLM's draft_tensor_parallel_size (1 or the target's), and
SGLang's draft parallel spec, under which an EAGLE3 draft with DP attention runs plain TP inside its attention-TP group
(DraftTPExecution.SINGLE_GROUP: no DP gather, no cross-DP collective). Here draft_tp_size is 1 or the target's
attn_tp_size, and the draft of a DP group runs on the first draft_tp_size ranks of its attention-TP group, as plain
TP over them (its layout ParallelLayout(tp_size=draft_tp_size), its collectives over those ranks only: DraftGroupComm).

What crosses between target and draft:
* hidden states: the target's hidden states (or EAGLE3's captured residual streams) are whole on every rank of the
  attention-TP group (every layer ends with its collective), rows of that DP group's requests only; a draft rank reads
  its own copy, which is exactly its requests' rows;
* proposals: the ranks without a draft (draft_tp_size < attn_tp_size) receive the draft's proposals from the group's
  first rank, a broadcast over the attention-TP group (`handoff_proposals`), every rank of the group verifying the same
  draft tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from runners.config import ModelConfig, SpecConfig, check_spec_fits_model
from runners.llama_eagle3 import check_draft_vocab_shards
from runners.parallel.comm import Group
from runners.parallel.dp_attention import RankContext
from runners.parallel.layout import LayoutError, ParallelLayout
from runners.scheduler import Proposal


def check_draft_tp_size(layout: ParallelLayout, spec: SpecConfig) -> None:
    d = spec.draft_tp_size
    if d is not None and d not in (1, layout.attn_tp_size):
        raise LayoutError(f"spec.draft_tp_size: 1 or the target's attn_tp_size ({layout.attn_tp_size}): the draft runs inside one "
                          f"attention-TP group, got {d}")


def check_draft_config(cfg: ModelConfig, layout: ParallelLayout, spec: SpecConfig) -> None:
    """What the draft's own settings ask of the target model and the layout; ValueError (LayoutError) naming the field."""
    check_spec_fits_model(cfg, spec)
    check_draft_vocab_shards(draft_layout(layout, spec), spec)


def draft_layout(layout: ParallelLayout, spec: SpecConfig) -> ParallelLayout:
    """The layout the draft runs in: the target's, or plain TP over draft_tp_size ranks."""
    check_draft_tp_size(layout, spec)
    return layout if spec.draft_tp_size is None else ParallelLayout(tp_size=spec.draft_tp_size)


@dataclass(frozen=True)
class DraftRankContext(RankContext):
    """A draft rank's context in the draft's own layout (tp_rank: its rank there), with the target's context of the
    same process: the DP group it serves is the target's (`served_dp_rank`)."""

    target: Optional[RankContext] = None


def served_dp_rank(ctx: RankContext) -> int:
    """The target DP group whose requests a draft context serves (its own for a draft in the target's layout)."""
    return ctx.target.attn_dp_rank if isinstance(ctx, DraftRankContext) and ctx.target is not None else ctx.attn_dp_rank


def draft_rank_context(ctx: RankContext, spec: SpecConfig) -> Optional[RankContext]:
    """The draft's context on this rank: the target's own without draft_tp_size, None on a rank that holds no draft."""
    layout = draft_layout(ctx.layout, spec)
    if spec.draft_tp_size is None:
        return ctx
    if ctx.attn_tp_rank >= spec.draft_tp_size:
        return None
    comm = None if ctx.comm is None else DraftGroupComm(ctx.comm, spec.draft_tp_size, ctx.tp_rank - ctx.attn_tp_rank)
    return DraftRankContext(layout, ctx.attn_tp_rank, comm, target=ctx)


def has_idle_ranks(layout: ParallelLayout, spec: SpecConfig) -> bool:
    """Some rank of an attention-TP group holds no draft: the group's first rank hands the proposals on."""
    return spec.draft_tp_size is not None and spec.draft_tp_size < layout.attn_tp_size


class DraftGroupComm:
    """A draft rank's communicator: the draft layout's groups mapped onto the target's. The draft group is the first
    draft_tp_size ranks of an attention-TP group, so it is that whole group (draft_tp_size == attn_tp_size) or this rank
    alone (draft_tp_size == 1, a collective over one rank is the tensor itself); a draft layout has no DP attention, so
    its ATTN_DP group is this rank alone."""

    def __init__(self, parent, draft_tp_size: int, leader: int):
        self.parent, self.draft_tp_size, self.leader = parent, draft_tp_size, leader
        self.rank, self.world_size = parent.rank, draft_tp_size

    def _mapped(self, group: Group) -> Optional[Group]:
        """The target group that is this draft group, None where the draft group is this rank alone."""
        return Group.ATTN_TP if self.draft_tp_size > 1 and Group(group) is not Group.ATTN_DP else None

    def group_ranks(self, group: Group) -> list[int]:
        return [self.rank] if self._mapped(group) is None else list(range(self.leader, self.leader + self.draft_tp_size))

    def all_reduce(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        g = self._mapped(group)
        return t if g is None else self.parent.all_reduce(t, g)

    def all_gather(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        g = self._mapped(group)
        return t if g is None else self.parent.all_gather(t, g)

    def reduce_scatter(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        g = self._mapped(group)
        return t if g is None else self.parent.reduce_scatter(t, g)

    def all_gather_v(self, t: torch.Tensor, lengths: Sequence[int], group: Group) -> torch.Tensor:
        g = self._mapped(group)
        return t[: lengths[0]] if g is None else self.parent.all_gather_v(t, lengths, g)

    def broadcast(self, t: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        g = self._mapped(group)
        return t if g is None else self.parent.broadcast(t, src, g)

    def barrier(self, group: Group) -> None:
        g = self._mapped(group)
        if g is not None:
            self.parent.barrier(g)


def handoff_group() -> Group:
    """The group the proposals cross: the attention-TP group, whose first rank holds a draft; each DP group hands on
    its own requests' proposals."""
    return Group.ATTN_TP


def handoff_proposals(ctx: RankContext, proposals: Optional[list[Proposal]], num_requests: int, num_steps: int, topk: int,
                      device: torch.device) -> list[Proposal]:
    """Every rank of the attention-TP group gets the proposals of the group's first rank (a draft rank); a rank without
    a draft passes None and its request count. Packed as the candidates [bs, num_steps, topk] (a proposal's chain is
    each depth's first candidate)."""
    if proposals is None:
        packed = torch.zeros(num_requests, num_steps, topk, dtype=torch.int64, device=device)
    else:
        packed = torch.tensor([p.candidates for p in proposals], dtype=torch.int64, device=device).reshape(num_requests, num_steps, topk)
    got = ctx.comm.broadcast(packed, 0, handoff_group()).tolist()
    return [Proposal([c[0] for c in cands], cands) for cands in got]
