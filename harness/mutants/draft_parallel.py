"""Mutants of a draft with a placement and a config of its own (runners.draft_parallel, runners.config.draft_model_config):
its rotary table, its layout, the hand-off of its proposals to the ranks that hold no draft.
"""
from __future__ import annotations

from dataclasses import replace

from harness.mutants.base import Mutant
from runners import draft_extend, draft_parallel
from runners.config import ModelConfig, SpecConfig
from runners.draft_parallel import DraftGroupComm
from runners.parallel.comm import Group
from runners.parallel.layout import ParallelLayout


def _target_config(cfg: ModelConfig, spec: SpecConfig) -> ModelConfig:
    return cfg  # the draft built with the target's config: the target's rotary base


def _checkpoint_positions(cfg: ModelConfig, spec: SpecConfig) -> ModelConfig:
    theta = cfg.rope_theta if spec.draft_rope_theta is None else spec.draft_rope_theta
    return replace(cfg, max_context_len=spec.draft_max_position_embeddings or cfg.max_context_len, rope_theta=theta)  # not raised


def _world_group() -> Group:
    return Group.WORLD  # every DP group receives the first DP group's proposals


def _target_layout(layout: ParallelLayout, spec: SpecConfig) -> ParallelLayout:
    return layout  # the draft resolved to the target's layout while it runs in its own group


def _group_spans_world(self: DraftGroupComm, group: Group) -> Group | None:
    return Group.WORLD if self.draft_tp_size > 1 and Group(group) is not Group.ATTN_DP else None  # every rank, not the group's


MUTANTS: list[Mutant] = [
    Mutant(
        "draft-reads-target-rotary",
        "the draft is built with the target's ModelConfig, not its own: its rotary table has the target's base "
        "(rope_theta), not the draft checkpoint's",
        "draft rotary table",
        ((draft_extend, "draft_model_config", _target_config),),
        ("draft-tp-tree", "draft-tp-loop"),  # P6 (the draft-tree golden's token ids and probabilities)
    ),
    Mutant(
        "draft-rotary-checkpoint-positions",
        "the draft's rotary table keeps the checkpoint's max_position_embeddings, fewer than the target's context, "
        "instead of being raised to it: a later position gathers past the table",
        "draft rotary table",
        ((draft_extend, "draft_model_config", _checkpoint_positions),),
        ("draft-tp-tree", "draft-tp-loop"),  # run (the rotary gather out of its table)
    ),
    Mutant(
        "draft-handoff-world-group",
        "the draft's proposals are broadcast over the world from rank 0 instead of over each attention-TP group from its "
        "first rank: every DP group verifies the first DP group's proposals",
        "draft proposal hand-off",
        ((draft_parallel, "handoff_group", _world_group),),
        ("draft-tp-tree", "draft-tp-loop"),  # run (DP groups of other sizes disagree on the broadcast's shape), P6
    ),
    Mutant(
        "draft-tp-in-target-layout",
        "the draft's model and runners are built with the target's layout while they run in the draft's own group: "
        "heads and MLP sharded for ranks that do not run the draft, gathered counts for DP groups it does not gather",
        "draft layout",
        ((draft_parallel, "draft_layout", _target_layout),),
        ("draft-tp-case",),  # P4 (the draft against the TP1 run of the same weights)
    ),
    Mutant(
        "draft-group-spans-world",
        "a draft at the attention-TP size maps its groups onto the target's world instead of its attention-TP group: "
        "its all-reduces sum over every DP group's ranks",
        "draft layout",
        ((DraftGroupComm, "_mapped", _group_spans_world),),
        ("draft-tp-group",),  # P4, or run where the DP groups' token counts differ
    ),
]
