"""The MLP-sync step of an eager pass: pad a short or idle DP rank's batch to the DP maximum, unpad after.

Under DP attention every DP rank gathers every rank's tokens before the MLP, padded to the
longest (MAX_LEN). The engine pads the ForwardBatch itself before the
forward, not only the gathered rows: the short rank then runs the whole pass (attention
included) over the padded lanes, as a graph replay runs its bucket, and the padded lanes
must be harmless the same way: request row 0 (the padding row) and position 0, so the
in-pass KV write slot lookup lands in the padding slot; seq_len the fill value; an
in-range accept length so a lane selects its own last token. After the forward only the
original rows are kept. global_num_tokens_for_logprob keeps the real counts: the padded
rows never reach lm_head.

Attention metadata and the padded batch: the engine builds the metadata once, for the padded
batch, and its kernels launch with the batch size the metadata remembers, so metadata planned
before the pad would leave the padded lanes uncomputed (or, planned after an unpad, launch past
the batch). Here every step body builds its metadata from the batch it is handed, which is the
padded one (prepare_mlp_sync_batch runs first), so both always agree. A planted disagreement
could not be told apart by any output: the padded lanes write only the padding slot, every op
after attention is row-wise (the DP gather, the MLP, the reduce-scatter keep rows apart), and
post_forward_mlp_sync_batch drops the padded rows before anything reads them; with the torch
reference a disagreement is a shape error, not a wrong value. So the mechanism is not modelled.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from runners.batch import EagleDraftInput, EagleVerifyInput, ForwardBatch
from runners.memory import PADDING_ROW
from runners.parallel.layout import DpPaddingMode, ParallelLayout

SEQ_LEN_FILL_VALUE = 1  # the attention backend's get_cuda_graph_seq_len_fill_value(): padded lanes here and in every graph


@dataclass(frozen=True)
class MlpSyncPadding:
    """What post_forward_mlp_sync_batch needs to give back the original rows."""

    original_batch_size: int
    original_num_tokens: int


def needs_dp_padding(layout: ParallelLayout, fb: ForwardBatch) -> bool:
    """Only a batch that carries the gathered token counts is synced: without a gathered
    buffer (the "neither" branch) every DP rank runs its own MLP on its own tokens. A SUM_LEN
    batch (a pass with an extending DP group, runners.mixed_modes) is gathered unpadded."""
    return (layout.require_mlp_sync and layout.attn_dp_size > 1 and fb.global_num_tokens_cpu is not None
            and fb.dp_padding_mode is DpPaddingMode.MAX_LEN)


def padded_lane_len(fb: ForwardBatch, lane_len: Optional[int]) -> Optional[int]:
    """A verify batch pads in whole trees of draft_token_num nodes: its custom mask is laid out per
    lane of T nodes, so a padded lane of any other length has no mask rows to attend with."""
    if isinstance(fb.spec_info, EagleVerifyInput):
        return fb.spec_info.draft_token_num
    return lane_len


def prepare_mlp_sync_batch(fb: ForwardBatch, layout: ParallelLayout, dp_tokens: Sequence[int],
                           lane_len: Optional[int], pad_row: int = PADDING_ROW) -> tuple[ForwardBatch, Optional[MlpSyncPadding]]:
    """fb padded to max(dp_tokens) tokens, and how to unpad; (fb, None) when nothing is padded.

    lane_len: tokens per padded lane (DRAFT_EXTEND_V2: num_tokens_per_bs, whole lanes); None
    for an EXTEND pass of lanes of any length, whose padding is one lane of the missing tokens.
    pad_row: the padded lanes' request row, the convention's (runners.memory.lane_padding).
    """
    n, target = fb.num_tokens, max(dp_tokens)
    if not needs_dp_padding(layout, fb) or target <= n:
        return fb, None
    extra = target - n
    lane_len = padded_lane_len(fb, lane_len)
    lens = [lane_len] * (extra // lane_len) if lane_len else [extra]
    starts = [n + lane_len * i for i in range(len(lens))] if lane_len else [n]
    dev = fb.input_ids.device

    def tokens(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros((extra, *t.shape[1:]))])

    def lanes(t: torch.Tensor, values: Sequence[int]) -> torch.Tensor:
        return torch.cat([t, torch.tensor(list(values), dtype=t.dtype, device=dev)])

    spec = fb.spec_info
    if isinstance(spec, EagleVerifyInput):  # padded lanes verify a chain: each node sees the ones before it
        T = spec.draft_token_num
        chain = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        spec = EagleVerifyInput(T, torch.cat([spec.custom_mask, chain.expand(len(lens), T, T)]))
    elif spec is not None:
        last = [m - 1 for m in lens]  # the lane's own last token: select indices stay inside the lane
        spec = EagleDraftInput(tokens(spec.hidden_states), lanes(spec.num_correct_drafts, last),
                               lanes(spec.num_accept_tokens, lens), spec.topk)
    gnt = None if fb.global_num_tokens_cpu is None else [target] * len(fb.global_num_tokens_cpu)
    padded = replace(
        fb,
        batch_size=fb.batch_size + len(lens),
        input_ids=tokens(fb.input_ids),
        positions=tokens(fb.positions),
        seq_lens=lanes(fb.seq_lens, [SEQ_LEN_FILL_VALUE] * len(lens)),
        req_pool_indices=lanes(fb.req_pool_indices, [pad_row] * len(lens)),
        out_cache_loc=tokens(fb.out_cache_loc),
        extend_seq_lens=lanes(fb.extend_seq_lens, lens),
        extend_start_loc=lanes(fb.extend_start_loc, starts),
        spec_info=spec,
        extend_seq_lens_cpu=list(fb.extend_seq_lens_cpu) + lens,
        extend_num_tokens=target,
        seq_lens_sum=fb.seq_lens_sum + SEQ_LEN_FILL_VALUE * len(lens),
        global_num_tokens_cpu=gnt,
        global_num_tokens_gpu=None if gnt is None else torch.tensor(gnt, dtype=torch.int32, device=dev),
    )
    return padded, MlpSyncPadding(fb.batch_size, n)


def post_forward_mlp_sync_batch(pad: Optional[MlpSyncPadding], per_token: Sequence[torch.Tensor],
                                per_lane: Sequence[torch.Tensor] = ()) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The original rows of a padded pass's outputs: the first tokens, the first lanes."""
    if pad is None:
        return list(per_token), list(per_lane)
    return [t[: pad.original_num_tokens] for t in per_token], [t[: pad.original_batch_size] for t in per_lane]
