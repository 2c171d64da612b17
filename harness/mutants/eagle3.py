"""Mutants of the EAGLE3 draft (runners.llama_eagle3) and of what the target and the graph runners keep for it: which
layers are captured, the widths of the buffers the captured states go through, the draft-to-target id table.

A buffer sized for fewer columns than the states it receives refuses the copy at replay (torch checks shapes, as
SGLang's aux packer does): the run fails. A wrong layer or a wrong id computes another draft, alike in eager and graph
and on every layout, so only the goldens see it: the draft-tree golden's token ids (exact) and probabilities (P6).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from harness.mutants.base import Mutant, Wrap
from runners import decode_cuda_graph_runner, eagle_draft, llama_eagle3
from runners.config import ModelConfig, SpecConfig
from runners.draft_extend_cuda_graph_runner import DraftExtendInputBuffers
from runners.model import TargetModel


def _capture_unshifted(self: TargetModel, layer_ids: Sequence[int]) -> None:
    self.layers_to_capture = list(layer_ids)  # layer i's input (layer i - 1's output) for id i: the +1 forgotten


def _one_layer_wide(cfg: ModelConfig, spec: SpecConfig) -> int:
    return cfg.hidden_size  # one captured layer's width, not num_aux times it


def _draft_extend_hidden_target_width(real: Callable[..., DraftExtendInputBuffers]) -> classmethod:
    def allocate(cls, worker) -> DraftExtendInputBuffers:
        b = real(worker)
        b.hidden_states = torch.zeros(b.hidden_states.shape[0], worker.cfg.hidden_size, dtype=b.hidden_states.dtype, device=b.hidden_states.device)
        return b

    return classmethod(allocate)


def _mapped_twice(hot_token_id, ids: torch.Tensor) -> torch.Tensor:
    return ids if hot_token_id is None else hot_token_id[hot_token_id[ids]]  # target ids taken for draft ids and mapped again


def _not_mapped(hot_token_id, ids: torch.Tensor) -> torch.Tensor:
    return ids  # the draft's ids embedded and verified as if they were target ids


def _differences_as_ids(d2t: torch.Tensor) -> torch.Tensor:
    return d2t  # the checkpoint's differences read as the target ids themselves (arange not added back)


MUTANTS: list[Mutant] = [
    Mutant(
        "eagle3-capture-unshifted",
        "the target captures each EAGLE3 layer id at that layer's input (the previous layer's output) instead of the "
        "next layer's: the draft reads the residual streams one layer early",
        "EAGLE3 captured layers",
        ((TargetModel, "set_eagle3_layers_to_capture", _capture_unshifted),),
        ("eagle3-tree", "eagle3-loop"),  # P6 (the draft-tree golden's probabilities)
    ),
    Mutant(
        "eagle3-verify-hidden-one-layer",
        "the target verify graph's hidden-state buffer is sized for one captured layer (hidden_size) instead of all of "
        "them: the replay's copy of the captured states does not fit",
        "EAGLE3 buffer width",
        ((decode_cuda_graph_runner, "draft_input_hidden_size", _one_layer_wide),),
        ("eagle3-loop",),  # run (the verify graph's copy)
    ),
    Mutant(
        "eagle3-draft-extend-hidden-target-width",
        "the draft-extend graph runner's hidden-state buffer is sized by the target's hidden size, not the captured "
        "layers' concatenation the target hands the draft",
        "EAGLE3 buffer width",
        ((DraftExtendInputBuffers, "allocate", Wrap(_draft_extend_hidden_target_width)),),
        ("eagle3-case",),  # run (the replay's copy of the live hidden states)
    ),
    Mutant(
        "eagle3-d2t-not-applied",
        "the EAGLE3 draft's top-k ids are never mapped to target ids: the draft decode embeds them and the verify checks "
        "them as target ids",
        "EAGLE3 draft-to-target ids",
        ((eagle_draft, "draft_to_target", _not_mapped), ("runners.draft_decode", "draft_to_target", _not_mapped)),
        ("eagle3-tree", "eagle3-loop"),  # P6 (the draft-tree golden's token ids)
    ),
    Mutant(
        "eagle3-d2t-applied-twice",
        "the draft decode maps its inputs' top-k ids to target ids although they are target ids already",
        "EAGLE3 draft-to-target ids",
        ((eagle_draft, "draft_to_target", _mapped_twice),),
        ("eagle3-tree", "eagle3-loop"),  # run (a target id past the draft vocabulary indexes the table), P6
    ),
    Mutant(
        "eagle3-d2t-differences-as-ids",
        "the draft-to-target table is read as target ids, not as the differences the checkpoint stores (draft id d is "
        "target id d + d2t[d])",
        "EAGLE3 draft-to-target ids",
        ((llama_eagle3, "hot_token_ids", _differences_as_ids),),
        ("eagle3-tree", "eagle3-loop"),  # P6 (the draft-tree golden's token ids)
    ),
]
