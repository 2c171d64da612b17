"""Mutants of the draft-extend runners' shape (issue 20 item 4) and of the eager MLP-sync padding (item 5)."""
from __future__ import annotations

from harness.mutants.base import Mutant
from runners import mlp_sync
from runners.eagle_draft_extend_cuda_graph_runner import EAGLEDraftExtendCudaGraphRunner


def _single_fill_logprob_requests(self: EAGLEDraftExtendCudaGraphRunner, bs: int) -> None:
    if self.buffers.global_num_tokens_gpu is not None:
        self.buffers.global_num_tokens_gpu.fill_(bs * self.T)
        self.buffers.global_num_tokens_for_logprob_gpu.fill_(bs)  # requests: the pruned count of a runner that selects rows


_REAL_SINGLE_FORWARD_BATCH = EAGLEDraftExtendCudaGraphRunner.get_forward_batch


def _single_forward_batch_logprob_requests(self: EAGLEDraftExtendCudaGraphRunner, bs: int):
    fb = _REAL_SINGLE_FORWARD_BATCH(self, bs)
    if fb.global_num_tokens_for_logprob_cpu is None:
        return fb
    fb.global_num_tokens_for_logprob_cpu = [bs] * len(fb.global_num_tokens_for_logprob_cpu)  # num_tokens_for_logprob = bs
    self.buffers.global_num_tokens_for_logprob_gpu.fill_(bs)
    return fb


_REAL_PREPARE = mlp_sync.prepare_mlp_sync_batch


def _unpad_keeps_last_rows(pad, per_token, per_lane=()):
    if pad is None:
        return list(per_token), list(per_lane)
    last = lambda t, k: t[t.shape[0] - k :]  # noqa: E731  the rows after the padding instead of before it
    return [last(t, pad.original_num_tokens) for t in per_token], [last(t, pad.original_batch_size) for t in per_lane]


def _pad_with_last_live_row(fb, layout, dp_tokens, lane_len, *pad_row):
    padded, pad = _REAL_PREPARE(fb, layout, dp_tokens, lane_len, *pad_row)
    if pad is not None and pad.original_batch_size:
        padded.req_pool_indices[pad.original_batch_size :] = fb.req_pool_indices[-1]  # not the padding row
    return padded, pad


MUTANTS: list[Mutant] = [
    Mutant(
        "single-layer-fill-logprob-requests",
        "single-layer draft-extend runner's own replay fill writes bs (requests) into global_num_tokens_for_logprob_gpu "
        "instead of bs * num_tokens_per_bs; the multi-layer runner's fill is right",
        "unit: requests vs tokens",
        ((EAGLEDraftExtendCudaGraphRunner, "_fill_gathered", _single_fill_logprob_requests),),
        ("metadata-dp", "metadata-grid"),  # P1 (fill, I1): only the metadata probes drive the single-layer runner
    ),
    Mutant(
        "single-layer-capture-logprob-requests",
        "single-layer draft-extend runner's own get_forward_batch bakes global_num_tokens_for_logprob = bs (requests, the "
        "engine's pruned single-layer count) instead of bs * num_tokens_per_bs, in every gathered branch; the multi-layer one is right",
        "one runner of two diverged",
        ((EAGLEDraftExtendCudaGraphRunner, "get_forward_batch", _single_forward_batch_logprob_requests),),
        ("metadata-dp", "metadata-grid"),  # P1: I6 (single vs multi-layer), I1, I5
    ),
    Mutant(
        "dp-unpad-last-rows",
        "eager MLP-sync unpad keeps the last original_num_tokens rows (and last lanes) of a padded pass instead of the "
        "first: a short DP rank hands on padded rows as its real ones",
        "unpad drops the wrong rows",
        ((mlp_sync, "post_forward_mlp_sync_batch", _unpad_keeps_last_rows),),
        ("batch-churn:tp2_dp2", "batch-churn", "spec-cases", "cases"),  # P8, P3/P4/P5; only the eager paths pad, and only under DP attention
    ),
    Mutant(
        "dp-pad-live-request-row",
        "eager MLP-sync padding gives the padded lanes the last live request row instead of the padding row: their "
        "in-pass KV slot lookup writes into that request's position-0 slot",
        "KV write for padded rows lands in a live slot",
        ((mlp_sync, "prepare_mlp_sync_batch", _pad_with_last_live_row),),
        ("batch-churn:tp2_dp2", "batch-churn", "spec-cases", "cases"),  # P8, P3/P4/P5: the corrupted position-0 KV changes later steps
    ),
]
