"""Per-branch gathered metadata: one helper for the eager path, capture and replay.

In DRAFT_EXTEND_V2 every value counts tokens (bs * num_tokens_per_bs), never requests
(docs/properties.md, I5).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from runners.parallel.layout import Branch, DpPaddingMode, ParallelLayout


@dataclass(frozen=True)
class GatheredMetadata:
    global_num_tokens: Optional[list[int]]
    global_num_tokens_for_logprob: Optional[list[int]]
    global_dp_buffer_len: Optional[int]

    @property
    def gpu_shape(self) -> Optional[tuple[int]]:
        return None if self.global_num_tokens is None else (len(self.global_num_tokens),)

    def forward_batch_fields(self, device: torch.device | str) -> dict[str, Any]:
        """The ForwardBatch fields of an eager batch (fresh gpu tensors); graph runners copy into static ones instead."""
        as_gpu = lambda xs: None if xs is None else torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
        return dict(
            global_num_tokens_cpu=self.global_num_tokens,
            global_num_tokens_gpu=as_gpu(self.global_num_tokens),
            global_num_tokens_for_logprob_cpu=self.global_num_tokens_for_logprob,
            global_num_tokens_for_logprob_gpu=as_gpu(self.global_num_tokens_for_logprob),
            global_dp_buffer_len=self.global_dp_buffer_len,
        )


def gathered_metadata(
    layout: ParallelLayout,
    tokens_per_dp_rank: Sequence[int],
    logprob_tokens_per_dp_rank: Sequence[int],
    dp_rank: int,
    padding: DpPaddingMode = DpPaddingMode.MAX_LEN,
) -> GatheredMetadata:
    """tokens_per_dp_rank: every DP group's token count (the MLP sync); lists of length dp. The gathered buffer holds
    every group padded to the longest (MAX_LEN) or their sum (SUM_LEN, a pass with an extending group)."""
    branch = layout.branch
    if branch is Branch.MLP_TP_GATHER:
        tokens = list(tokens_per_dp_rank)
        buffer_len = sum(tokens) if padding is DpPaddingMode.SUM_LEN else max(tokens) * layout.attn_dp_size
        return GatheredMetadata(tokens, list(logprob_tokens_per_dp_rank), buffer_len)
    if branch is Branch.ATTN_TP_GATHER:
        own = tokens_per_dp_rank[dp_rank] if len(tokens_per_dp_rank) > 1 else tokens_per_dp_rank[0]
        own_lp = logprob_tokens_per_dp_rank[dp_rank] if len(logprob_tokens_per_dp_rank) > 1 else logprob_tokens_per_dp_rank[0]
        return GatheredMetadata([own], [own_lp], own)
    return GatheredMetadata(None, None, None)
