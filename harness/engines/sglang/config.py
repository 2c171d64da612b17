"""The speculative config every engine run uses."""
from __future__ import annotations

from dataclasses import dataclass

from harness.engines.after_model import VOCAB


@dataclass(frozen=True)
class EngineConfig:
    """The speculative config and buckets every engine run uses (and our runners' defaults)."""

    num_steps: int = 3
    topk: int = 1
    # the graphed draft decode runs at a wider top-k: DECODE counts bs * topk tokens, so at topk 1 a count of
    # requests where tokens are meant would be the same number and pass
    draft_decode_topk: int = 2
    num_draft_tokens: int = 4
    capture_bs: tuple[int, ...] = (1, 2, 4, 8, 16)
    max_running_requests: int = 16
    hidden_size: int = 8
    vocab_size: int = VOCAB  # the stand-in model's vocabulary (after_model.py)

