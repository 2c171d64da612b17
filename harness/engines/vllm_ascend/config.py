"""The serving flags engine-check drives vllm-ascend's EAGLE proposer under."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class GraphMode(enum.Enum):
    """The cudagraph_mode a user sets (vLLM's CUDAGraphMode names). The draft's merged graph is a FULL graph either way;
    the mode decides the target's dispatch keys, which the proposer dispatches through, and how the runner pads
    query_start_loc for FIA (_pad_query_start_loc_for_fia's two branches)."""

    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"  # uniform-decode keys: a padded request gets 1 + K tokens
    FULL = "FULL"  # mixed keys for every size: the padded tokens go to one dummy request


@dataclass(frozen=True)
class AscendCheckConfig:
    # K: the merged graph runs K draft steps (step 0 over the verified tokens, steps 1..K-1 one row per request)
    num_speculative_tokens: int = 3
    max_num_seqs: int = 8
    # cudagraph_capture_sizes (tokens) as a user gives them; vLLM rounds them to multiples of 1 + K (4):
    # 4, 8, 16, 24, 32 tokens = 1, 2, 4, 6, 8 requests
    cudagraph_capture_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32)
    max_model_len: int = 512
    modes: tuple[GraphMode, ...] = (GraphMode.FULL_DECODE_ONLY, GraphMode.FULL)
    # (DP size, MoE draft) of each world per mode. A MoE draft (MTP-style) makes the draft's DP agreement a collective
    # (should_skip_allreduce_across_dp_group); a dense EAGLE draft skips it and every rank pads alone
    dp_worlds: tuple[tuple[int, bool], ...] = ((1, False), (2, False), (2, True))
    # per DP rank, the raw request counts of the schedule, growing and then shrinking: 4 then 3, 6 then 5, 8 then 7
    # requests share a graph (a batch that shrinks within a bucket); rank r runs max(1, size - 2 * r)
    schedule: tuple[int, ...] = (1, 4, 3, 6, 5, 8, 7, 2)

    def worlds(self) -> list["World"]:
        return [World(mode, dp, moe) for mode in self.modes for dp, moe in self.dp_worlds]

    def dp_schedule(self, dp_size: int) -> list[list[int]]:
        up = [[max(1, s - 2 * r) for r in range(dp_size)] for s in self.schedule]
        return up + up[::-1][1:]


@dataclass(frozen=True)
class World:
    """One driven world: the graph mode, the DP size, whether the draft is MoE (its DP agreement a collective)."""

    mode: GraphMode
    dp: int
    moe: bool

    @property
    def label(self) -> str:
        return f"{self.mode.value} dp={self.dp}" + (" moe" if self.moe else "")
