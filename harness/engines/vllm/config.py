"""The engine configuration engine-check drives vLLM's EAGLE proposer under (a user's serving flags)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VllmCheckConfig:
    # K: the target verifies 1 + K tokens per request; K - 1 = 1 draft decode step (each one runs the
    # interpreted slot-mapping kernel: the check's time goes there)
    num_speculative_tokens: int = 2
    # K of the draft decode paths' own worlds: 3 runs two draft steps, so what a step leaves for the next (the
    # sampled id, positions and seq_lens advanced, slot mappings and metadata refreshed) is read by a forward and
    # checked; the K above keeps a world (target, draft prefill, per-step decode) whose capture sizes it sets
    decode_num_speculative_tokens: int = 3
    # the DP sizes of those worlds (the decode's DP agreement, reused or its own up to 0.29, is checked at every size in the K world)
    decode_dp_sizes: tuple[int, ...] = (1, 2)
    max_num_seqs: int = 24
    # Token cap of uniform decode graphs: 64 // (1 + K) = 21 requests at K = 2, below max_num_seqs and not a
    # configured size: the verify-width graphs stop at that cap (the first size above it is captured at 21),
    # which the one-token draft decode graphs do not share.
    max_cudagraph_capture_size: int = 64
    # decode_cudagraph_capture_request_sizes as a user would pass them; 24 is above the verify-width cap
    decode_request_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24)
    # cudagraph_capture_sizes (tokens) as a user would pass them to a token-keyed release (up to 0.33), whose
    # max is its max_cudagraph_capture_size: at 1 + K = 3 they round to 1, 2, 3, 6, 8, 11, 16 requests while 64
    # (22 requests, 66 tokens) overshoots the cap, so 17..21 requests run PIECEWISE at 64 tokens and more run
    # eager; the one-token draft decode keeps 1, 2, 4, 8, 16, 24 (max_num_seqs).
    cudagraph_capture_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    max_model_len: int = 256
    dp_sizes: tuple[int, ...] = (1, 2, 4)
    # the draft decode paths driven, each its own DP worlds: the per-step loop (False) and the fused multi-step graph
    # (True), which the release takes when the draft's attention backends can update decode metadata in place
    fused_decode: tuple[bool, ...] = (False, True)
    # per DP rank, the raw request counts of the schedule, each replayed growing and then shrinking;
    # rank r runs max(1, size - 3 * r), so ranks differ and DP padding matters. 4 requests at 1 + K = 3 pad the
    # token-keyed target to its 6-request graph while a 4-request draft decode graph exists: a draft decode that
    # pads from the target's padded count instead of the ranks' real one takes the larger graph.
    schedule: tuple[int, ...] = (1, 3, 4, 6, 9, 13, 16, 19, 23)

    def dp_schedule(self, dp_size: int) -> list[list[int]]:
        """Per iteration, each rank's raw requests, growing then shrinking: each (per-rank sizes) tuple runs once after
        smaller batches and once after larger ones."""
        up = [[max(1, s - 3 * r) for r in range(dp_size)] for s in self.schedule]
        return up + up[::-1][1:]
