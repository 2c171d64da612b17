"""The built-in mutant catalog: named, reversible patches of one behaviour each.

A mutant never edits a file: it monkeypatches one method or function of `runners` for
the duration of a `with mutant.planted():` block. `harness mutants` plants each one in
a child process, runs the probes that can see it (`probes`, ids from harness.suite.PROBES,
cheapest first; unset: every probe) and reports which property killed it. A list holds
every probe that fails with the mutant planted, and the comment beside it which properties
fail; `harness mutants --all-probes --all-properties --only ID` re-derives it. A property that cannot
kill any mutant is not shown to work; a mutant no property kills is a hole.
"""
from __future__ import annotations

from unittest import mock

import torch

from harness import execute
from harness.mutant_base import Mutant
from harness.mutants_decode import MUTANTS as _DECODE
from harness.mutants_shape import MUTANTS as _SHAPE
from harness.mutants_verify import MUTANTS as _VERIFY
from runners import model
from runners.cuda_graph import EagleDraftExtendCudaGraphRunnerBase, MultiLayerEagleDraftExtendCudaGraphRunner
from runners.parallel.comm import Group
from runners.parallel.layout import Branch

# ---- the replacements, each a one-line deviation from the real code ----


def _seed_get_forward_batch(self: EagleDraftExtendCudaGraphRunnerBase, bs: int):
    fb = _REAL_ML_GET_FORWARD_BATCH(self, bs)
    if self.layout.branch is not Branch.ATTN_TP_GATHER:
        return fb
    # sglang#26416: the attn-TP-gather branch of the multi-layer runner counted requests
    fb.global_num_tokens_for_logprob_cpu = [bs]
    self.global_num_tokens_for_logprob_gpu.fill_(bs)  # baked from the host list
    return self._keep_capture_record(fb)


_REAL_ML_GET_FORWARD_BATCH = MultiLayerEagleDraftExtendCudaGraphRunner.get_forward_batch


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
        ((MultiLayerEagleDraftExtendCudaGraphRunner, "get_forward_batch", _seed_get_forward_batch),),
        ("metadata-grid", "spec-cases", "cases"),  # P1 (grid, cases), P3/P4 (cases), P6; P2, P7, P8 pass with it planted
    ),
    Mutant(
        "capture-num-tokens-gpu-requests",
        "MLP-TP-gather branch: global_num_tokens_gpu baked as [bs] per DP rank at capture; only the replay fill writes bs * num_tokens_per_bs",
        "fixed in replay, not in capture",
        ((EagleDraftExtendCudaGraphRunnerBase, "get_forward_batch", _capture_num_tokens_gpu_requests),),
        ("metadata-grid", "cases"),  # P1 only: the replay fill rewrites the value before any forward
    ),
    Mutant(
        "stale-padded-seq-lens",
        "replay reset skips seq_lens = fill: after the batch shrinks, padded lanes keep the seq_lens of the earlier, larger batch",
        "stale padded lane after shrink",
        ((EagleDraftExtendCudaGraphRunnerBase, "reset_for_iteration", _reset_without_seq_len_fill),),
        ("metadata-grid", "padded-lanes", "cases"),  # P1 (grid, cases), P2
    ),
    Mutant(
        "replay-positions-off-by-one",
        "replay copies the live positions shifted by one into the static positions buffer",
        "position off by one",
        ((EagleDraftExtendCudaGraphRunnerBase, "_copy_live_inputs", _copy_positions_off_by_one),),
        ("batch-churn", "cases"),  # P8, P3/P4 (cases); the grid runs no model
    ),
    Mutant(
        "bucket-floor",
        "replay picks the largest captured bs <= raw_bs instead of the smallest >= raw_bs",
        "padding rule",
        ((EagleDraftExtendCudaGraphRunnerBase, "_choose_bucket", _bucket_floor),),
        ("metadata-grid", "p7-idle-ranks", "padded-lanes", "batch-churn", "spec-cases", "cases"),  # every probe replays buckets: P1, P7, and a crash (run) in the others
    ),
    Mutant(
        "attn-allreduce-world-group",
        "attention o_proj all-reduce over the world group instead of the attn-TP group under DP attention",
        "collective over the wrong group",
        ((model.DecoderLayer, "forward", _o_proj_all_reduce_world),),
        ("p7-idle-ranks", "padded-lanes", "cases"),  # P7, a desync (run) in P2 and cases; needs DP attention with attn_tp > 1 and a model
    ),
    Mutant(
        "dp-scatter-wrong-chunk",
        "MLP-TP gather: after the MLP each DP group keeps the next DP group's rows (a broken layout gather)",
        "broken layout gather",
        ((model, "dp_scatter", _dp_scatter_wrong_chunk),),
        ("padded-lanes", "batch-churn", "spec-cases", "cases"),  # P2, P8, P5, P3/P4; the grid runs no model, P7 passes
    ),
    Mutant(
        "idle-rank-skips-mlp-sync",
        "an idle DP rank (no requests) skips the MLP-sync all_gather of batch sizes over the attn-DP group: busy ranks wait in it while the idle rank runs on",
        "idle DP rank skips a collective",
        ((execute, "mlp_sync_batch_sizes", _mlp_sync_idle_rank_skips),),
        ("p7-idle-ranks", "cases"),  # P7, a desync (run) in cases; the other probes pass with it planted
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


def _accept_per_request(parents, tokens, argmax) -> list[int]:
    return list(range(len(tokens) if list(tokens[1:2]) == [argmax[0]] else 1))  # the first verdict applied to all its tokens


def _copy_advances_padded_seq_lens(self: EagleDraftExtendCudaGraphRunnerBase, inp) -> None:
    _REAL_COPY(self, inp)
    self.seq_lens[inp.bs :] += self.T  # padded rows advanced as if they had extended T tokens too


def _eagle_pairs_next_step_hidden(tokens_after: torch.Tensor, hidden: torch.Tensor):
    return tokens_after, torch.cat([hidden[1:], hidden[-1:]])  # row j: the hidden state of position j + 1


def _copy_pads_with_last_live_slot(self: EagleDraftExtendCudaGraphRunnerBase, inp) -> None:
    _REAL_COPY(self, inp)
    if inp.bs:  # the step body looks write slots up through the request row: pad rows with the last live one
        self.req_pool_indices[inp.bs :] = inp.req_pool_indices[-1]


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
        ("padded-lanes", "batch-churn"),  # P2, P8; harmless to outputs here unless poisoned or churned
    ),
    Mutant(
        "accept-per-request",
        "greedy verify decides acceptance once per request (its first draft token) and applies it to all its tokens, instead of token by token along the chain",
        "acceptance per request instead of per token",
        ((verify, "accept_path", _accept_per_request),),
        ("batch-churn", "spec-cases"),  # P8, P5/P6: verify runs only in the speculative-loop probes
    ),
    Mutant(
        "seq-len-advanced-for-padded-rows",
        "replay copy-in advances the seq_lens of the padded lanes by num_tokens_per_bs, as if padded rows had extended too (they should stay at the fill value)",
        "seq_len advanced for padded rows",
        ((EagleDraftExtendCudaGraphRunnerBase, "_copy_live_inputs", _copy_advances_padded_seq_lens),),
        ("metadata-grid", "padded-lanes", "cases"),  # P1 (grid, cases), P2
    ),
    Mutant(
        "draft-hidden-next-step",
        "EAGLE pairing off by one step: draft row j reads token j+1 with the target hidden state of position j+1 instead of j (prefill and draft-extend)",
        "hidden state from the wrong step",
        ((draft_decode, "eagle_pairs", _eagle_pairs_next_step_hidden),),
        ("spec-cases",),  # P6 only: the EAGLE pairing of the loop
    ),
    Mutant(
        "padded-kv-write-live-slot",
        "replay pads req_pool_indices by repeating the last live request row: the step body looks the padded rows' KV write slots up through it, so they land in that request's slots",
        "KV write for padded rows lands in a live slot",
        ((EagleDraftExtendCudaGraphRunnerBase, "_copy_live_inputs", _copy_pads_with_last_live_slot),),
        ("padded-lanes", "batch-churn", "cases"),  # P2, P8, P3/P4
    ),
    Mutant(
        "attn-reads-masked-kv",
        "reference attention multiplies masked (probability 0) KV entries instead of excluding them: a NaN in the padding slot or a stale slot reaches every real row",
        "padded / stale memory read into a real row",
        ((TorchAttnBackend, "masked_values", staticmethod(_attn_reads_masked_kv)),),
        ("padded-lanes",),  # P2 only: masked KV is finite here unless poisoned
    ),
    Mutant(
        "padded-accept-len-zero",
        "replay reset gives padded lanes accept length 0 (num_correct_drafts -1) instead of keeping an in-range value: a padded lane's select index is the last token of the lane before it, so the first padded lane overwrites the last real lane's next input id",
        "padded lane writes into a real lane",
        ((EagleDraftExtendCudaGraphRunnerBase, "reset_for_iteration", _reset_marks_padded_lanes_unaccepted),),
        ("padded-lanes", "batch-churn", "cases"),  # P2, P8, P3/P4
    ),
)

# ---- issue 20: memory addressed as engines address it; non-unit norms (P2 / P5 / P6 kill these) ----
from runners import memory as _memory  # noqa: E402
from runners import scheduler as _scheduler  # noqa: E402
from runners.attention.torch_ref import AttnMetadata, token_to_request  # noqa: E402
from runners.model import TargetModel  # noqa: E402


def _reset_keeps_request_rows(self: EagleDraftExtendCudaGraphRunnerBase, raw_bs: int, accept_lens: torch.Tensor) -> None:
    saved = self.req_pool_indices.clone()
    _REAL_RESET(self, raw_bs, accept_lens)
    self.req_pool_indices.copy_(saved)  # padded lanes keep the rows of the last, larger batch (SGLang before 0.5.23)


def _reset_keeps_positions(self: EagleDraftExtendCudaGraphRunnerBase, raw_bs: int, accept_lens: torch.Tensor) -> None:
    saved = self.positions.clone()
    _REAL_RESET(self, raw_bs, accept_lens)
    self.positions.copy_(saved)  # padded lanes gather rotary rows and look slots up at the larger batch's positions


def _target_hands_on_normed_hidden(self: TargetModel, fb, attn, meta):
    _, normed = _REAL_TARGET_FORWARD(self, fb, attn, meta)
    return normed, normed  # the draft gets the final-normed hidden state instead of the last layer's output


_REAL_TARGET_FORWARD = TargetModel.forward


def _truncate_frees_kept_page(self: _scheduler.KVBook, req, num_positions: int) -> None:
    if len(req.slots) > num_positions:
        pages = _memory.pages_of(req.slots, self.page_size)
        self.allocator.release(pages[num_positions // self.page_size :])  # floor: the partly kept page is freed too
        del req.slots[num_positions:]


def _page_table_first_slots(self: TorchAttnBackend, fb):
    """The page table taken as a row's first slots (req_to_token[:, :num_pages]) instead of every page's first slot."""
    token_to_req = token_to_request(fb)
    ps = self.kv_pool.page_size
    width = self.req_pool.req_to_token.shape[1]
    page_table = self.req_pool.req_to_token[fb.req_pool_indices, : -(-width // ps)] // ps
    key_pos = torch.arange(width)
    kv_slots = page_table[token_to_req][:, key_pos // ps] * ps + key_pos % ps
    seq_len = fb.seq_lens[token_to_req]
    key_mask = (key_pos[None, :] < seq_len[:, None]) & (key_pos[None, :] <= fb.positions[:, None])
    return AttnMetadata(token_to_req, kv_slots, key_mask)


CATALOG = CATALOG + (
    Mutant(
        "stale-padded-req-pool-indices",
        "replay reset leaves req_pool_indices alone (the fill SGLang 0.5.23 added): after the batch shrinks, padded lanes keep the larger batch's request rows and the in-graph slot lookup writes their KV into slots those rows point at",
        "in-graph slot lookup through a stale row",
        ((EagleDraftExtendCudaGraphRunnerBase, "reset_for_iteration", _reset_keeps_request_rows),),
    ),
    Mutant(
        "stale-padded-positions",
        "replay reset leaves positions alone: after the batch shrinks, padded lanes gather rotary rows and look write slots up at the larger batch's positions (harmless while their row is the padding row: only the fill check sees it)",
        "stale padded position",
        ((EagleDraftExtendCudaGraphRunnerBase, "reset_for_iteration", _reset_keeps_positions),),
    ),
    Mutant(
        "target-hidden-after-final-norm",
        "the target hands the draft its hidden states after the final norm instead of before (invisible with unit norm weights: the draft's hnorm undoes a plain RMS normalisation)",
        "hidden state handed on after the norm",
        ((TargetModel, "forward", _target_hands_on_normed_hidden),),
    ),
    Mutant(
        "truncate-frees-kept-page",
        "after a verify the KV book frees the pages past num_positions // page_size instead of past ceil(num_positions / page_size): the page holding the last kept positions goes back on the free list while the request still uses it (page_size > 1 only)",
        "allocator hands out a page still referenced",
        ((_scheduler.KVBook, "truncate", _truncate_frees_kept_page),),
    ),
    Mutant(
        "page-table-first-slots",
        "the attention page table is built from the first num_pages entries of each req_to_token row instead of every page_size-th: keys past the first page are read from the wrong pages (page_size > 1 only)",
        "page table built wrong",
        ((TorchAttnBackend, "init_forward_metadata", _page_table_first_slots),),
    ),
)

BY_ID: dict[str, Mutant] = {m.id: m for m in CATALOG}


def get(mutant_id: str) -> Mutant:
    if mutant_id not in BY_ID:
        raise KeyError(f"unknown mutant {mutant_id!r}; known: {', '.join(BY_ID)}")
    return BY_ID[mutant_id]


# ---- issue 20 item 3: the TARGET_VERIFY graph runner's replay fill (runners.verify_graph) ----
# Killed by: the seq_lens fill by P1 (padded seq_lens / seq_lens_sum, the metadata grid); the
# req_pool_indices fill (in-graph slot lookup) by P3 (harness.verify_props: live target KV after the pass) and P5/P8 (a
# corrupted committed KV changes later tokens); the gathered fill by P1 (the replay fill) and
# P3/P5 on a DP-gather case. input_ids and positions of padded lanes have no mutant: behind the
# padding row nothing reads them into a real row (TargetVerifyCudaGraphRunner._fill_padded_lanes).
from runners.verify_graph import TargetVerifyCudaGraphRunner  # noqa: E402

_REAL_VERIFY_FILL = TargetVerifyCudaGraphRunner._fill_padded_lanes


def _verify_fill_keeps(buffer: str):
    def fill(self: TargetVerifyCudaGraphRunner, raw_bs: int) -> None:
        saved = getattr(self, buffer).clone()
        _REAL_VERIFY_FILL(self, raw_bs)
        getattr(self, buffer).copy_(saved)  # padded lanes keep the last, larger batch's values of this buffer

    return fill


def _verify_fill_gathered_requests(self: TargetVerifyCudaGraphRunner, bs: int) -> None:
    if self.global_num_tokens_gpu is not None:
        self.global_num_tokens_gpu.fill_(bs)  # requests, not tokens: lm_head gets the first bs rows only
        self.global_num_tokens_for_logprob_gpu.fill_(bs)


CATALOG = CATALOG + (
    Mutant(
        "verify-stale-padded-seq-lens",
        "TARGET_VERIFY replay fill skips seq_lens of the padded lanes: after the batch shrinks they keep the larger batch's lengths, so the baked seq_lens_sum no longer matches the buffer",
        "stale padded lane after shrink",
        ((TargetVerifyCudaGraphRunner, "_fill_padded_lanes", _verify_fill_keeps("seq_lens")),),
    ),
    Mutant(
        "verify-padded-kv-write-stale-slot",
        "TARGET_VERIFY replay fill skips req_pool_indices of the padded lanes: their in-graph slot lookup goes through the larger batch's request rows, so they write KV into slots of requests that may still be running",
        "KV write for padded rows lands in a live slot",
        ((TargetVerifyCudaGraphRunner, "_fill_padded_lanes", _verify_fill_keeps("req_pool_indices")),),
    ),
    Mutant(
        "verify-gathered-tokens-requests",
        "TARGET_VERIFY replay fill writes bs (requests) into global_num_tokens_gpu / global_num_tokens_for_logprob_gpu instead of bs * num_draft_tokens",
        "unit: requests vs tokens",
        ((TargetVerifyCudaGraphRunner, "_fill_gathered", _verify_fill_gathered_requests),),
    ),
)
BY_ID.update({m.id: m for m in CATALOG})


# ---- issue 15: bugs only a graph that replays kernels, not Python, shows ----
# Each body is correct whenever its Python runs with live host state, so a CPU graph that
# re-ran the body at replay passed them all; the recorded graph (runners.graph_record)
# freezes host values at capture and refuses host reads, as a CUDA graph does.
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
BY_ID.update({m.id: m for m in CATALOG})
CATALOG += tuple(_DECODE); BY_ID.update({m.id: m for m in _DECODE})  # noqa: E702
CATALOG += tuple(_SHAPE); BY_ID.update({m.id: m for m in _SHAPE})  # noqa: E702
CATALOG += tuple(_VERIFY); BY_ID.update({m.id: m for m in _VERIFY})  # noqa: E702
