"""The speculative config every engine run uses, and one rank's live batch at replay."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """The speculative config and buckets every engine run uses (and our runners' defaults)."""

    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4
    capture_bs: tuple[int, ...] = (1, 2, 4, 8, 16)
    max_running_requests: int = 16
    hidden_size: int = 8
    vocab_size: int = 32


@dataclass
class LiveBatch:
    """One rank's raw batch at replay: sizes per DP group, this rank's lanes."""

    raw_bs: int
    dp_batch_sizes: list[int]
    seq_lens: list[int]
    accept_lens: list[int]
