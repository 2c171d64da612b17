"""ForwardMode, ForwardBatch and the EAGLE spec info, with the engine's field names.

Host-side values (ints, lists) are what a CUDA graph bakes at capture; tensors are
views of static buffers that replay reads. Keeping the two apart in one dataclass is
what lets the CPU graph simulation be honest.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum, auto
from typing import Optional

import torch

from runners.parallel.layout import DpPaddingMode


def host_copy(host: Optional[torch.Tensor], device_tensor: torch.Tensor) -> torch.Tensor:
    """The host copy a caller kept (the scheduler knows every length on the host), else one read back
    from the device: a sync, which a caller that keeps its host values never pays."""
    return host if host is not None else device_tensor.cpu()


class ForwardMode(Enum):
    EXTEND = auto()  # prefill of a prefix
    DECODE = auto()
    DRAFT_EXTEND = auto()
    DRAFT_EXTEND_V2 = auto()  # fixed num_tokens_per_bs tokens per request, logits for all of them
    IDLE = auto()  # a DP rank with no requests still runs the padded dummy path
    TARGET_VERIFY = auto()  # the target over num_draft_tokens tokens per request, logits for all of them

    def is_draft_extend_v2(self) -> bool:
        return self is ForwardMode.DRAFT_EXTEND_V2

    def is_target_verify(self) -> bool:
        return self is ForwardMode.TARGET_VERIFY


class CaptureHiddenMode(Enum):
    NULL = auto()
    LAST = auto()
    FULL = auto()


@dataclass
class EagleDraftInput:
    hidden_states: torch.Tensor  # [N, H] target (step 0) or previous draft layer hidden states
    num_correct_drafts: torch.Tensor  # [bs] accepted draft tokens = accept_len - 1
    num_accept_tokens: torch.Tensor  # [bs]
    topk: int = 1
    last_token_indices: Optional[torch.Tensor] = None  # [bs] ragged draft-extend: each request's last token row (vLLM's)


@dataclass
class EagleVerifyInput:
    """A TARGET_VERIFY batch's tree: every request's draft_token_num nodes and their tree mask
    (runners.verify); the attention backends apply the mask, the step body derives each node's
    KV write slot from the root's position and the node's index."""

    draft_token_num: int  # T, host: baked
    custom_mask: torch.Tensor  # [bs, T, T] bool, mask[b, i, j]: node i of lane b sees node j
    custom_mask_cpu: Optional[torch.Tensor] = None  # host copy of custom_mask, for a host-side plan (None: none kept)


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    seq_lens: torch.Tensor  # [bs] incl. the extend tokens
    req_pool_indices: torch.Tensor  # [bs]
    out_cache_loc: torch.Tensor  # [N] KV slots written by this pass
    extend_seq_lens: torch.Tensor  # [bs]
    extend_start_loc: torch.Tensor  # [bs]
    spec_info: Optional[EagleDraftInput | EagleVerifyInput]
    extend_seq_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: Optional[torch.Tensor] = None  # host copy of seq_lens: a host-planned backend reads it, not the device
    extend_num_tokens: int = 0
    num_token_non_padded: int = 0
    seq_lens_sum: int = 0
    global_num_tokens_cpu: Optional[list[int]] = None
    global_num_tokens_gpu: Optional[torch.Tensor] = None
    global_num_tokens_for_logprob_cpu: Optional[list[int]] = None
    global_num_tokens_for_logprob_gpu: Optional[torch.Tensor] = None
    global_dp_buffer_len: Optional[int] = None
    dp_padding_mode: DpPaddingMode = DpPaddingMode.MAX_LEN
    return_logprob: bool = False
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.FULL

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def host_metadata(self) -> dict:
        """The host values a graph bakes (what the CPU simulation freezes at capture)."""
        return {
            "forward_mode": self.forward_mode.name,
            "batch_size": self.batch_size,
            "num_tokens": self.num_tokens,
            "extend_num_tokens": self.extend_num_tokens,
            "global_num_tokens_cpu": None if self.global_num_tokens_cpu is None else list(self.global_num_tokens_cpu),
            "global_num_tokens_for_logprob_cpu": None
            if self.global_num_tokens_for_logprob_cpu is None
            else list(self.global_num_tokens_for_logprob_cpu),
            "global_dp_buffer_len": self.global_dp_buffer_len,
            "dp_padding_mode": self.dp_padding_mode.value,
        }

    def frozen(self) -> "ForwardBatch":
        """A copy whose host lists can't be mutated by later code (tensors still alias the buffers)."""
        return replace(
            self,
            extend_seq_lens_cpu=list(self.extend_seq_lens_cpu),
            global_num_tokens_cpu=None if self.global_num_tokens_cpu is None else tuple(self.global_num_tokens_cpu),
            global_num_tokens_for_logprob_cpu=None
            if self.global_num_tokens_for_logprob_cpu is None
            else tuple(self.global_num_tokens_for_logprob_cpu),
        )
