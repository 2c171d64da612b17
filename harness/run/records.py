"""What P1 reads from a graph runner, taken from outside: one bucket's capture, one replay.

Our runners (harness.run.observe) and an engine's (harness.engines) are observed into the same
two records, so harness.props checks both with one code. Every value keeps the engine's
name from the runner to the report: the host lists are the ForwardBatch's
global_num_tokens_cpu / global_num_tokens_for_logprob_cpu (in `host`), the static tensors
global_num_tokens_gpu / global_num_tokens_for_logprob_gpu.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass(frozen=True)
class CaptureRecord:
    """The capture side of invariant I1: one bucket's host metadata and gathered tensors as baked."""

    bs: int
    num_tokens: int
    host: dict
    global_num_tokens_gpu: Optional[list[int]]
    global_num_tokens_for_logprob_gpu: Optional[list[int]]


@dataclass(frozen=True)
class ReplayRecord:
    """One replay: its bucket's capture record, the static buffers after the replay fill, and what
    the graph fed lm_head (None when no graph ran: the metadata-only path)."""

    runner: str  # a runners.base_cuda_graph_runner.RunnerKind for ours; an engine's runner name for theirs
    step: int
    branch: str
    raw_bs: int
    bs: int
    tokens_per_bs: int
    capture: CaptureRecord
    global_num_tokens_gpu: Optional[list[int]]
    global_num_tokens_for_logprob_gpu: Optional[list[int]]
    gpu_shape: Optional[tuple[int, ...]]
    padded_seq_lens: list[int]
    seq_lens_sum: int
    seq_lens_sum_actual: int
    rows_fed: Optional[int] = None
    logits_rows: Optional[int] = None
    captured_bs: list[int] = field(default_factory=list)
    host_mirror_stale_lanes: Optional[list[int]] = None  # lanes whose host seq_lens / tree mask differ from the device's (None: no mirror)


def tensor_values(t: Optional[torch.Tensor]) -> Optional[list[int]]:
    """A small static int tensor read back to the host (a device sync: an engine never does this)."""
    return None if t is None else [int(x) for x in t.tolist()]
