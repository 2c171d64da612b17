"""SGLang's DFlash target verify graphs: the target's DecodeCudaGraphRunner in TARGET_VERIFY mode for DFLASH (0.5.14 on).

DFlash drafts a block of T tokens per request in one draft forward and verifies the block on
the target in one TARGET_VERIFY forward: the same runner class, capture and replay fill as the
EAGLE verify graphs (target_verify.py), with the DFlash family's spec input
(DecodeCudaGraphRunner.get_spec_info's DFlashVerifyInput branch: the block width, the custom
mask only where the attention backend cannot express the block's causal mask itself, no EAGLE
tree, no hidden-state rows for an MTP head). Driven as target_verify.py drives EAGLE's, with the
target's algorithm DFLASH, on the layouts DFlash accepts (arg_groups/speculative_hook.py,
_handle_dflash: DP attention requires --enable-dp-lm-head), each on its own `dflash_verify` lines.

The compact ragged verify (per-request verify lengths) is DSpark's (SpeculativeAlgorithm.
supports_ragged_verify), driven by ragged_verify.py; DFlash's draft graph is `DFLASH_DRAFT`.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Optional

import torch

from harness.engines.lanes import FILLED_SINCE
from harness.engines.sglang import target_verify
from harness.engines.sglang.graph import import_quietly
from harness.engines.sglang.target_verify import TargetVerify
from runners.parallel.layout import ParallelLayout

KIND = "dflash_verify"
INFO = "sglang.srt.speculative.dflash_info"
FILLED = frozenset(b for (k, b) in FILLED_SINCE if k == target_verify.KIND)  # the same registry's padding policies
MLP_TP_LAYOUT = ParallelLayout(4, 2, True, None, True)  # DFlash's MLP-TP gather: DP attention with the dp lm head it requires
DFLASH_DRAFT = (
    "dflash_draft (DFlash's draft graph: the draft model runner's DecodeCudaGraphRunner in TARGET_VERIFY mode over the block): "
    "not driven: under DP attention DFlash runs its draft eagerly (dflash_worker_v2.py, init_cuda_graphs: \"Disable DFLASH draft "
    "cuda graph because dp attention is enabled\"), so its graph has no gathered buffer or DP count to check; on the other layouts "
    "its capture and replay fill are the decode runner's, checked here and on target_verify, with a draft batch "
    "(input embeddings of the block, the draft sampler's capture hook) the adapter does not build")


@dataclasses.dataclass(frozen=True)
class Loaded:
    mod: types.ModuleType
    model_runner_cls: type
    info: types.ModuleType


def load(engine: Any) -> tuple[Optional[Loaded], str]:
    mod, mr_cls, why = target_verify.load(engine)
    if mod is None:
        return None, why
    mods, why = import_quietly(INFO)
    if mods is None:
        return None, why
    info = mods[0]
    if not hasattr(info, "DFlashVerifyInput") or "DFLASH" not in engine.modules["spec_info"].SpeculativeAlgorithm.__members__:
        return None, "the release has no DFLASH algorithm with a DFlashVerifyInput"
    return Loaded(mod, mr_cls, info), ""


def layouts(run_layouts: tuple[ParallelLayout, ...]) -> tuple[tuple[ParallelLayout, str], ...]:
    """The run's layouts DFlash accepts, and its MLP-TP gather layout (DP attention needs the dp lm head)."""
    kept = [(lay, "") for lay in run_layouts if not lay.enable_dp_attention or lay.enable_dp_lm_head]
    if not any(lay.require_mlp_tp_gather for lay, _ in kept):
        kept.append((MLP_TP_LAYOUT, "MLP-TP gather: DFlash's DP attention (with the dp lm head _handle_dflash requires)"))
    return tuple(kept)


def build(loaded: Loaded, runners: Any) -> TargetVerify:
    fbi, info = runners.engine.modules["fbi"], loaded.info

    def verify_input(T: int, tok: dict, raw: int) -> Any:
        """DFlashWorkerV2's verify input: the block's tokens and positions at the block width (its custom mask, where the
        backend needs one, covers the block's causal rows: its content is not read here)."""
        return info.DFlashVerifyInput(draft_token=tok["input_ids"], positions=tok["positions"], draft_token_num=T,
                                      custom_mask=torch.ones(raw * T * T, dtype=torch.bool), capture_hidden_mode=fbi.CaptureHiddenMode.FULL)

    return TargetVerify(loaded.mod, loaded.model_runner_cls, runners, kind=KIND, algorithm="DFLASH", verify_input=verify_input)


def check(tv: TargetVerify, layout: ParallelLayout, d: int, tp_rank: int, line, per_request: dict) -> None:
    target_verify.check(tv, layout, d, tp_rank, line, FILLED, per_request)
