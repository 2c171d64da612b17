"""The built-in mutant catalog: named, reversible patches of one behaviour each.

A mutant never edits a file: it monkeypatches one method or function of `runners` for
the duration of a `with mutant.planted():` block. `harness mutants` plants each one,
runs the fast properties and reports which property killed it. A property that cannot
kill any mutant is not shown to work; a mutant no property kills is a hole.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator
from unittest import mock

import torch

from harness import execute
from runners import model
from runners.cuda_graph import EagleDraftExtendCudaGraphRunnerBase, MultiLayerEagleDraftExtendCudaGraphRunner
from runners.parallel.comm import Group
from runners.parallel.layout import Branch


@dataclass(frozen=True)
class Mutant:
    id: str
    description: str
    kind: str  # what family of bug it stands for
    patches: tuple[tuple[object, str, object], ...] = field(default=())  # (target, attribute, replacement)

    @contextlib.contextmanager
    def planted(self) -> Iterator["Mutant"]:
        with contextlib.ExitStack() as stack:
            for target, attr, new in self.patches:
                if not hasattr(target, attr):
                    raise AttributeError(f"mutant {self.id}: {target!r} has no attribute {attr!r} to patch (the code moved?)")
                stack.enter_context(mock.patch.object(target, attr, new))
            yield self


# ---- the replacements, each a one-line deviation from the real code ----


def _seed_capture_for_logprob(self: EagleDraftExtendCudaGraphRunnerBase, bs: int) -> int:
    # sglang#26416: the attn-TP-gather branch of the multi-layer runner counted requests
    if self.layout.branch is Branch.ATTN_TP_GATHER:
        return bs
    return bs * self.T


def _capture_num_tokens_gpu_requests(self: EagleDraftExtendCudaGraphRunnerBase, bs: int) -> torch.Tensor:
    fb = _REAL_GET_FORWARD_BATCH(self, bs)
    if self.layout.branch is Branch.MLP_TP_GATHER:
        self.global_num_tokens_gpu.fill_(bs)  # fixed in the replay fill, not at capture
        self.capture_records[bs].global_num_tokens_gpu = [bs] * self.global_num_tokens_gpu.shape[0]
    return fb


_REAL_GET_FORWARD_BATCH = EagleDraftExtendCudaGraphRunnerBase.get_forward_batch
_REAL_RESET = EagleDraftExtendCudaGraphRunnerBase.reset_for_iteration


def _reset_without_seq_len_fill(self: EagleDraftExtendCudaGraphRunnerBase, raw_bs: int, accept_lens: torch.Tensor) -> None:
    saved = self.seq_lens.clone()
    _REAL_RESET(self, raw_bs, accept_lens)
    self.seq_lens.copy_(saved)  # padded lanes keep the seq_lens of the last, larger batch


def _copy_positions_off_by_one(self: EagleDraftExtendCudaGraphRunnerBase, inp) -> None:
    _REAL_COPY(self, inp)
    raw_n = inp.bs * self.T
    self.positions[:raw_n].copy_(inp.positions + 1)


_REAL_COPY = EagleDraftExtendCudaGraphRunnerBase._copy_live_inputs


def _bucket_floor(self: EagleDraftExtendCudaGraphRunnerBase, needed: int) -> int:
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


_REAL_MLP_SYNC = execute.mlp_sync_batch_sizes


def _mlp_sync_idle_rank_skips(ctx, local_bs, device):
    """An idle DP rank skips the scheduler's MLP sync (all_gather over attn-DP) and assumes every group idle."""
    if local_bs == 0 and ctx.layout.require_mlp_sync and ctx.layout.attn_dp_size > 1:
        return [0] * ctx.layout.attn_dp_size
    return _REAL_MLP_SYNC(ctx, local_bs, device)


CATALOG: tuple[Mutant, ...] = (
    Mutant(
        "sglang-26416",
        "multi-layer runner, attn-TP-gather branch: get_forward_batch(bs) sets global_num_tokens_for_logprob = [bs] (requests) instead of [bs * num_tokens_per_bs]",
        "unit: requests vs tokens",
        ((MultiLayerEagleDraftExtendCudaGraphRunner, "_capture_for_logprob", _seed_capture_for_logprob),),
    ),
    Mutant(
        "capture-num-tokens-gpu-requests",
        "MLP-TP-gather branch: global_num_tokens_gpu baked as [bs] per DP rank at capture; only the replay fill writes bs * num_tokens_per_bs",
        "fixed in replay, not in capture",
        ((EagleDraftExtendCudaGraphRunnerBase, "get_forward_batch", _capture_num_tokens_gpu_requests),),
    ),
    Mutant(
        "stale-padded-seq-lens",
        "replay reset skips seq_lens = fill: after the batch shrinks, padded lanes keep the seq_lens of the earlier, larger batch",
        "stale padded lane after shrink",
        ((EagleDraftExtendCudaGraphRunnerBase, "reset_for_iteration", _reset_without_seq_len_fill),),
    ),
    Mutant(
        "replay-positions-off-by-one",
        "replay copies the live positions shifted by one into the static positions buffer",
        "position off by one",
        ((EagleDraftExtendCudaGraphRunnerBase, "_copy_live_inputs", _copy_positions_off_by_one),),
    ),
    Mutant(
        "bucket-floor",
        "replay picks the largest captured bs <= raw_bs instead of the smallest >= raw_bs",
        "padding rule",
        ((EagleDraftExtendCudaGraphRunnerBase, "_choose_bucket", _bucket_floor),),
    ),
    Mutant(
        "attn-allreduce-world-group",
        "attention o_proj all-reduce over the world group instead of the attn-TP group under DP attention",
        "collective over the wrong group",
        ((model.DecoderLayer, "forward", _o_proj_all_reduce_world),),
    ),
    Mutant(
        "dp-scatter-wrong-chunk",
        "MLP-TP gather: after the MLP each DP group keeps the next DP group's rows (a broken layout gather)",
        "broken layout gather",
        ((model, "dp_scatter", _dp_scatter_wrong_chunk),),
    ),
    Mutant(
        "idle-rank-skips-mlp-sync",
        "an idle DP rank (no requests) skips the MLP-sync all_gather of batch sizes over the attn-DP group: busy ranks wait in it while the idle rank runs on",
        "idle DP rank skips a collective",
        ((execute, "mlp_sync_batch_sizes", _mlp_sync_idle_rank_skips),),
    ),
)

# ---- issue 8: the speculative decoding loop (runners.spec_decode); P2 / P5 / P6 / P8 kill these ----
from runners import draft_decode, verify  # noqa: E402
from runners.attention.torch_ref import TorchAttnBackend  # noqa: E402

_TOKEN_BUFFERS = ("input_ids", "positions", "out_cache_loc")


def _reset_keeps_token_buffers(self: EagleDraftExtendCudaGraphRunnerBase, raw_bs: int, accept_lens: torch.Tensor) -> None:
    saved = [getattr(self, b).clone() for b in _TOKEN_BUFFERS]
    _REAL_RESET(self, raw_bs, accept_lens)
    for b, old in zip(_TOKEN_BUFFERS, saved, strict=True):
        getattr(self, b).copy_(old)  # padded lanes keep the larger batch's tokens, positions and KV slots


def _accept_per_request(drafts: torch.Tensor, target_argmax: torch.Tensor) -> torch.Tensor:
    first = (drafts[:, 0] == target_argmax[:, 0]).to(torch.int64)
    return first * drafts.shape[1] + 1  # the request's first verdict applied to every one of its tokens


def _copy_advances_padded_seq_lens(self: EagleDraftExtendCudaGraphRunnerBase, inp) -> None:
    _REAL_COPY(self, inp)
    self.seq_lens[inp.bs :] += self.T  # padded rows advanced as if they had extended T tokens too


def _eagle_pairs_next_step_hidden(tokens_after: torch.Tensor, hidden: torch.Tensor):
    return tokens_after, torch.cat([hidden[1:], hidden[-1:]])  # row j: the hidden state of position j + 1


def _copy_pads_with_last_live_slot(self: EagleDraftExtendCudaGraphRunnerBase, inp) -> None:
    _REAL_COPY(self, inp)
    raw_n = inp.bs * self.T
    if raw_n:
        self.out_cache_loc[raw_n:] = inp.out_cache_loc[-1]  # pad by repeating the last live entry, not the padding slot


def _reset_marks_padded_lanes_unaccepted(self: EagleDraftExtendCudaGraphRunnerBase, raw_bs: int, accept_lens: torch.Tensor) -> None:
    _REAL_RESET(self, raw_bs, accept_lens)
    self.num_accept_tokens[raw_bs:].fill_(0)  # padded lanes "accepted nothing" ...
    self.num_correct_drafts[raw_bs:].fill_(-1)  # ... so their select index, lane * T - 1, is the previous lane's last token


def _attn_reads_masked_kv(vals: torch.Tensor, meta) -> torch.Tensor:
    """The reference attention before masked values were zeroed: a probability-0 key still multiplies its value."""
    return vals


CATALOG = CATALOG + (
    Mutant(
        "stale-padded-tokens-after-shrink",
        "replay reset leaves input_ids, positions and out_cache_loc alone: after the batch shrinks, padded lanes replay the larger batch's tokens and write their KV into its slots",
        "stale padded lane after shrink",
        ((EagleDraftExtendCudaGraphRunnerBase, "reset_for_iteration", _reset_keeps_token_buffers),),
    ),
    Mutant(
        "accept-per-request",
        "greedy verify decides acceptance once per request (its first draft token) and applies it to all its tokens, instead of token by token along the chain",
        "acceptance per request instead of per token",
        ((verify, "chain_accept_lens", _accept_per_request),),
    ),
    Mutant(
        "seq-len-advanced-for-padded-rows",
        "replay copy-in advances the seq_lens of the padded lanes by num_tokens_per_bs, as if padded rows had extended too (they should stay at the fill value)",
        "seq_len advanced for padded rows",
        ((EagleDraftExtendCudaGraphRunnerBase, "_copy_live_inputs", _copy_advances_padded_seq_lens),),
    ),
    Mutant(
        "draft-hidden-next-step",
        "EAGLE pairing off by one step: draft row j reads token j+1 with the target hidden state of position j+1 instead of j (prefill and draft-extend)",
        "hidden state from the wrong step",
        ((draft_decode, "eagle_pairs", _eagle_pairs_next_step_hidden),),
    ),
    Mutant(
        "padded-kv-write-live-slot",
        "replay pads out_cache_loc by repeating the last live slot: the padded rows' KV writes land in the last real token's slot",
        "KV write for padded rows lands in a live slot",
        ((EagleDraftExtendCudaGraphRunnerBase, "_copy_live_inputs", _copy_pads_with_last_live_slot),),
    ),
    Mutant(
        "attn-reads-masked-kv",
        "reference attention multiplies masked (probability 0) KV entries instead of excluding them: a NaN in the padding slot or a stale slot reaches every real row",
        "padded / stale memory read into a real row",
        ((TorchAttnBackend, "masked_values", staticmethod(_attn_reads_masked_kv)),),
    ),
    Mutant(
        "padded-accept-len-zero",
        "replay reset gives padded lanes accept length 0 (num_correct_drafts -1) instead of keeping an in-range value: a padded lane's select index is the last token of the lane before it, so the first padded lane overwrites the last real lane's next input id",
        "padded lane writes into a real lane",
        ((EagleDraftExtendCudaGraphRunnerBase, "reset_for_iteration", _reset_marks_padded_lanes_unaccepted),),
    ),
)

BY_ID: dict[str, Mutant] = {m.id: m for m in CATALOG}


def get(mutant_id: str) -> Mutant:
    if mutant_id not in BY_ID:
        raise KeyError(f"unknown mutant {mutant_id!r}; known: {', '.join(BY_ID)}")
    return BY_ID[mutant_id]


# ---- issue 15: bugs only a graph that replays kernels, not Python, shows ----
# Each body is correct whenever its Python runs with live host state, so a CPU graph that
# re-ran the body at replay passed them all; the recorded graph (runners.graph_record)
# freezes host values at capture and refuses host reads, as a CUDA graph does.
from runners.attention.torch_ref import AttnMetadata  # noqa: E402
from runners.draft_extend import SEQ_LEN_FILL_VALUE  # noqa: E402
from runners.memory import ReqToTokenPool  # noqa: E402

_REAL_BODY = EagleDraftExtendCudaGraphRunnerBase._body
_REAL_TORCH_METADATA = TorchAttnBackend.init_forward_metadata
_REAL_REQ_ALLOC = ReqToTokenPool.alloc


def _keys_below(meta: AttnMetadata, kv_len: int) -> AttnMetadata:
    """Attention over key positions [0, kv_len) only: exact while kv_len >= every live seq_len (the rest is masked)."""
    return AttnMetadata(meta.token_to_req, meta.kv_slots[:, :kv_len], meta.key_mask[:, :kv_len])


def _forward_batch_sets_host_max_seq_len(self: EagleDraftExtendCudaGraphRunnerBase, bs: int):
    self.host_max_seq_len = SEQ_LEN_FILL_VALUE  # the bucket's batch: every seq_len is the fill value
    return _REAL_GET_FORWARD_BATCH(self, bs)


def _copy_sets_host_max_seq_len(self: EagleDraftExtendCudaGraphRunnerBase, inp) -> None:
    _REAL_COPY(self, inp)
    self.host_max_seq_len = int(inp.seq_lens.max()) if inp.bs else SEQ_LEN_FILL_VALUE  # outside the graph: a legal host read


def _body_keys_below_host_max_seq_len(self: EagleDraftExtendCudaGraphRunnerBase, fb):
    attn, kv_len = self.worker.attn, self.host_max_seq_len  # a runner attribute the body reads on the host

    def metadata(fb):
        return _keys_below(_REAL_TORCH_METADATA(attn, fb), kv_len)

    with mock.patch.object(attn, "init_forward_metadata", metadata):
        return _REAL_BODY(self, fb)


def _alloc_rebinds_req_to_token(self: ReqToTokenPool) -> int:
    idx = _REAL_REQ_ALLOC(self)
    self.req_to_token = self.req_to_token.clone()  # copy-on-write: the new row goes to a new table, not the captured one
    return idx


def _metadata_reads_max_seq_len(self: TorchAttnBackend, fb) -> AttnMetadata:
    kv_len = int(fb.seq_lens.max()) if fb.seq_lens.numel() else SEQ_LEN_FILL_VALUE  # a device-to-host read in the step body
    return _keys_below(_REAL_TORCH_METADATA(self, fb), kv_len)


CATALOG = CATALOG + (
    Mutant(
        "kv-len-from-host-attribute",
        "the draft-extend body limits attention to the keys below a max seq_len the runner keeps on the host (set by "
        "get_forward_batch, then by each replay's copy-in): correct whenever the body's Python runs, but a graph bakes "
        "the capture-time value (the fill seq_len), so replays attend one key. A CPU graph that re-ran the body passed it",
        "host value frozen at capture",
        (
            (EagleDraftExtendCudaGraphRunnerBase, "get_forward_batch", _forward_batch_sets_host_max_seq_len),
            (EagleDraftExtendCudaGraphRunnerBase, "_copy_live_inputs", _copy_sets_host_max_seq_len),
            (EagleDraftExtendCudaGraphRunnerBase, "_body", _body_keys_below_host_max_seq_len),
        ),
    ),
    Mutant(
        "req-to-token-rebound",
        "ReqToTokenPool.alloc copies the request map to a new tensor (copy-on-write) instead of writing the row in "
        "place: the step body reads worker.req_pool.req_to_token live, so a body re-run sees the new table, but a "
        "graph keeps the table it captured and replays with stale KV slot rows",
        "static buffer rebound after capture",
        ((ReqToTokenPool, "alloc", _alloc_rebinds_req_to_token),),
    ),
    Mutant(
        "attn-metadata-host-sync",
        "the reference attention's metadata reads max(seq_lens) to the host (int(t), a device sync) to trim the key "
        "range: exact in eager and in a body re-run, but a CUDA graph capture fails at the read, and so does the CPU "
        "graph's (GraphCaptureError: the run property, as on a GPU)",
        "host sync inside capture",
        ((TorchAttnBackend, "init_forward_metadata", _metadata_reads_max_seq_len),),
    ),
)
BY_ID = {m.id: m for m in CATALOG}
