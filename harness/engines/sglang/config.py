"""The speculative config every engine run uses."""
from __future__ import annotations

from dataclasses import dataclass

from harness.engines.after_model import VOCAB


@dataclass(frozen=True)
class EngineConfig:
    """The speculative config and buckets every engine run uses (and our runners' defaults)."""

    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4
    capture_bs: tuple[int, ...] = (1, 2, 4, 8, 16)
    max_running_requests: int = 16
    hidden_size: int = 8
    vocab_size: int = VOCAB  # the stand-in model's vocabulary (after_model.py)

