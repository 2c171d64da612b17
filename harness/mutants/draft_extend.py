"""Mutants of the draft-extend graph runners' metadata and of the layout collectives (P1, P3, P4 kill these)."""
from __future__ import annotations

from unittest import mock

import torch

from harness.mutants.base import Mutant, keeps
from harness.run import rig
from runners import draft_extend, model
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import MultiLayerEagleDraftExtendCudaGraphRunner
from runners.parallel.comm import Group
from runners.parallel.layout import Branch

# ---- the replacements, each a one-line deviation from the real code ----


def _eager_logprob_requests(dp_batch_sizes: list[int], T: int) -> tuple[list[int], list[int]]:
    # what SGLang's eager draft-extend batch does (num_tokens_for_logprob_per_req = 1) while lm_head sees every token
    return [b * T for b in dp_batch_sizes], list(dp_batch_sizes)


def _seed_get_forward_batch(self: MultiLayerEagleDraftExtendCudaGraphRunner, bs: int):
    fb = REAL_GET_FORWARD_BATCH(self, bs)
    if self.layout.branch is not Branch.ATTN_TP_GATHER:
        return fb
    # sglang#26416: the attn-TP-gather branch of the multi-layer runner counted requests
    fb.global_num_tokens_for_logprob_cpu = [bs]
    self.global_num_tokens_for_logprob_gpu.fill_(bs)  # baked from the host list
    return fb



def _capture_num_tokens_gpu_requests(self: MultiLayerEagleDraftExtendCudaGraphRunner, bs: int) -> torch.Tensor:
    fb = REAL_GET_FORWARD_BATCH(self, bs)
    if self.layout.branch is Branch.MLP_TP_GATHER:
        self.global_num_tokens_gpu.fill_(bs)  # fixed in the replay fill, not at capture
    return fb


REAL_GET_FORWARD_BATCH = MultiLayerEagleDraftExtendCudaGraphRunner.get_forward_batch
REAL_RESET = MultiLayerEagleDraftExtendCudaGraphRunner.reset_for_iteration


def _copy_positions_off_by_one(self: MultiLayerEagleDraftExtendCudaGraphRunner, inp) -> None:
    REAL_COPY(self, inp)
    raw_n = inp.bs * self.T
    self.positions[:raw_n].copy_(inp.positions + 1)


REAL_COPY = MultiLayerEagleDraftExtendCudaGraphRunner._copy_live_inputs


def _bucket_floor(self: MultiLayerEagleDraftExtendCudaGraphRunner, needed: int) -> int:
    import bisect

    i = bisect.bisect_right(self.capture_bs, needed) - 1  # largest bucket <= needed
    return self.capture_bs[max(i, 0)]


def _o_proj_all_reduce_world(self, x, fb, attn, meta):
    """The attention all-reduce over the world group instead of attn-TP (DP attention layouts)."""
    ctx = self.ctx
    real_all_reduce = ctx.comm.all_reduce

    def wrong(t, group):
        return real_all_reduce(t, Group.WORLD if group is Group.ATTN_TP and ctx.layout.attn_dp_size > 1 else group)

    with mock.patch.object(ctx.comm, "all_reduce", wrong):
        return _REAL_LAYER_FORWARD(self, x, fb, attn, meta)


_REAL_LAYER_FORWARD = model.DecoderLayer.forward


def _dp_scatter_wrong_chunk(ctx, gathered_partial, num_local, sharded):
    if sharded and ctx.attn_tp_size > 1:
        gathered_partial = ctx.comm.all_reduce(gathered_partial, Group.ATTN_TP)
    if sharded:
        gathered_partial = ctx.comm.all_reduce(gathered_partial, Group.ATTN_DP)
    dp = ctx.layout.attn_dp_size
    max_len = gathered_partial.shape[0] // dp
    d = (ctx.attn_dp_rank + 1) % dp  # another DP group's rows
    return gathered_partial[d * max_len : (d + 1) * max_len][:num_local]


_REAL_MLP_SYNC = rig.mlp_sync_batch_sizes


def _mlp_sync_idle_rank_skips(ctx, local_bs, device):
    """An idle DP rank skips the scheduler's MLP sync (all_gather over attn-DP) and assumes every group idle."""
    if local_bs == 0 and ctx.layout.require_mlp_sync and ctx.layout.attn_dp_size > 1:
        return [0] * ctx.layout.attn_dp_size
    return _REAL_MLP_SYNC(ctx, local_bs, device)


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "sglang-26416",
        "multi-layer runner, attn-TP-gather branch: get_forward_batch(bs) sets global_num_tokens_for_logprob = [bs] (requests) instead of [bs * num_tokens_per_bs]",
        "unit: requests vs tokens",
        ((MultiLayerEagleDraftExtendCudaGraphRunner, "get_forward_batch", _seed_get_forward_batch),),
        ("metadata-grid:chains-tp1", "metadata-grid", "spec-cases", "cases"),  # P1 (grid, cases), P3/P4 (cases), P6; P2, P7, P8 pass with it planted
    ),
    Mutant(
        "capture-num-tokens-gpu-requests",
        "MLP-TP-gather branch: global_num_tokens_gpu baked as [bs] per DP rank at capture; only the replay fill writes bs * num_tokens_per_bs",
        "fixed in replay, not in capture",
        ((MultiLayerEagleDraftExtendCudaGraphRunner, "get_forward_batch", _capture_num_tokens_gpu_requests),),
        ("metadata-dp", "metadata-grid", "cases"),  # P1 only: the replay fill rewrites the value before any forward
    ),
    Mutant(
        "stale-padded-seq-lens",
        "replay reset skips seq_lens = fill: after the batch shrinks, padded lanes keep the seq_lens of the earlier, larger batch",
        "stale padded lane after shrink",
        ((MultiLayerEagleDraftExtendCudaGraphRunner, "reset_for_iteration", keeps(REAL_RESET, "seq_lens")),),
        ("metadata-dp", "metadata-grid", "padded-lanes", "cases"),  # P1 (grid, cases), P2
    ),
    Mutant(
        "replay-positions-off-by-one",
        "replay copies the live positions shifted by one into the static positions buffer",
        "position off by one",
        ((MultiLayerEagleDraftExtendCudaGraphRunner, "_copy_live_inputs", _copy_positions_off_by_one),),
        ("batch-churn:tp1", "batch-churn", "cases"),  # P8, P3/P4 (cases); the grid runs no model
    ),
    Mutant(
        "bucket-floor",
        "replay picks the largest captured bs <= raw_bs instead of the smallest >= raw_bs",
        "padding rule",
        ((MultiLayerEagleDraftExtendCudaGraphRunner, "_choose_bucket", _bucket_floor),),
        ("metadata-dp", "metadata-grid", "p7-idle-ranks", "padded-lanes", "batch-churn", "spec-cases", "cases"),  # every probe replays buckets: P1, P7, and a crash (run) in the others
    ),
    Mutant(
        "attn-allreduce-world-group",
        "attention o_proj all-reduce over the world group instead of the attn-TP group under DP attention",
        "collective over the wrong group",
        ((model.DecoderLayer, "forward", _o_proj_all_reduce_world),),
        ("cases:tp4_dp2_mlp_tp_gather", "padded-lanes", "cases"),  # P3/P4 (the DP cases with attn_tp > 1), a desync (run) in P2; P7's schedules pass with it planted
    ),
    Mutant(
        "dp-scatter-wrong-chunk",
        "MLP-TP gather: after the MLP each DP group keeps the next DP group's rows (a broken layout gather)",
        "broken layout gather",
        ((model, "dp_scatter", _dp_scatter_wrong_chunk),),
        ("padded-lanes:tp4_dp2_mlp_tp_gather", "padded-lanes", "batch-churn", "spec-cases", "cases"),  # P2, P8, P5, P3/P4; the grid runs no model, P7 passes
    ),
    Mutant(
        "eager-logprob-requests",
        "the eager reference's batch counts one logprob row per request (bs_r) while its logits processor feeds lm_head all bs_r * T, "
        "as SGLang's eager draft-extend path does in the gathered branches (docs/engine-check.md, I7)",
        "unit: requests vs tokens (eager)",
        ((draft_extend, "tokens_and_logprob_tokens", _eager_logprob_requests),),
        ("cases:tp2_shrink", "cases"),
    ),
    Mutant(
        "idle-rank-skips-mlp-sync",
        "an idle DP rank (no requests) skips the MLP-sync all_gather of batch sizes over the attn-DP group: busy ranks wait in it while the idle rank runs on",
        "idle DP rank skips a collective",
        ((rig, "mlp_sync_batch_sizes", _mlp_sync_idle_rank_skips),),
        ("p7-idle-ranks", "cases"),  # P7, a desync (run) in cases; the other probes pass with it planted
    ),
)

