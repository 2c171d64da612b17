"""Mutants of vLLM's padding convention and of vLLM's shapes of the draft-extend (the ragged runner, PIECEWISE graphs):
one per mechanism, each killed on CPU by the cheapest probe over the case that enables it (the case probes of
harness.pipeline.mutants; P2's padded-lanes-pad-minus-one)."""
from __future__ import annotations

import torch

from harness.mutants.base import Mutant, Wrap
from runners import mlp_sync, ragged_draft_extend
from runners.memory import PADDING_ROW, TokenToKVPool, write_slots
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import MultiLayerEagleDraftExtendCudaGraphRunner
from runners.piecewise_draft_extend_cuda_graph_runner import PiecewiseDraftExtendCudaGraphRunner
from runners.ragged_draft_extend import RaggedPlan

PAD_MINUS_ONE, PAD_MINUS_ONE_P2 = "case-pad-minus-one", "padded-lanes-pad-minus-one"
RAGGED, PIECEWISE = "case-ragged", "case-piecewise"


def _write_without_skip(self: TokenToKVPool, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The classic bug: a write by advanced indexing, which takes slot -1 as the pool's last slot."""
    self.k[layer][loc] = k.to(self.k[layer].dtype)
    self.v[layer][loc] = v.to(self.v[layer].dtype)


def _reset_pads_row_zero(real):
    def reset_for_iteration(self: MultiLayerEagleDraftExtendCudaGraphRunner, raw_bs: int, accept_lens: torch.Tensor) -> None:
        real(self, raw_bs, accept_lens)
        self.req_pool_indices[raw_bs:].fill_(PADDING_ROW)  # SGLang's padding row, whatever the convention

    return reset_for_iteration


def _mlp_sync_pads_row_zero(real):
    def prepare_mlp_sync_batch(fb, layout, dp_tokens, lane_len, pad_row=PADDING_ROW):
        return real(fb, layout, dp_tokens, lane_len, PADDING_ROW)

    return prepare_mlp_sync_batch


def _padded_without_index(real):
    def padded(self: RaggedPlan, bs: int):
        starts, lens, _ = real(self, bs)
        return starts, lens, []  # the padded lanes' gather index is not written: it keeps a larger batch's rows

    return padded


def _slots_through_lane(worker, fb, token_to_req):
    """Every token's slot through its lane's request row, the tokens past every lane's extent included."""
    rows = fb.req_pool_indices[token_to_req]
    return fb.out_cache_loc.copy_(write_slots(worker.req_pool.req_to_token, rows, fb.positions, worker.req_pool.pad_slot))


def _attention_for_bucket(real):
    def fill(self: PiecewiseDraftExtendCudaGraphRunner, inp) -> int:
        bs = real(self, inp)
        self.buffers.live_bs = bs  # the eager attention built for the padded bucket, its stale lanes included
        return bs

    return fill


def _dense_counts_live(real):
    def fill(self: PiecewiseDraftExtendCudaGraphRunner, inp) -> int:
        bs = real(self, inp)
        if self.global_num_tokens_gpu is not None:  # the dense pieces' gathered counts for the live tokens
            self.global_num_tokens_gpu.fill_(inp.bs * self.T)
            self.global_num_tokens_for_logprob_gpu.fill_(inp.bs * self.T)
        return bs

    return fill


def _not_padded(self: PiecewiseDraftExtendCudaGraphRunner, num_tokens: int) -> int:
    return num_tokens


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "kv-write-pad-slot-not-skipped",
        "the KV write does not skip PAD_SLOT_ID: written by advanced indexing, a padded lane's slot -1 is the pool's last "
        "slot, which the write overwrites (vLLM's reshape_and_cache returns on slot < 0)",
        "padding slot -1 written from the end",
        ((TokenToKVPool, "write", _write_without_skip),),
        (PAD_MINUS_ONE_P2,),  # P2 (the slot -1 lands in changes across a clean replay)
    ),
    Mutant(
        "pad-minus-one-fill-pads-row-zero",
        "under vLLM's convention the multi-layer replay fill pads req_pool_indices with 0, SGLang's padding row: no row is "
        "reserved there, so a padded lane writes its KV into the slots of the request that holds row 0",
        "padding value of the other convention",
        ((MultiLayerEagleDraftExtendCudaGraphRunner, "reset_for_iteration", Wrap(_reset_pads_row_zero)),),
        (PAD_MINUS_ONE, PAD_MINUS_ONE_P2),  # P3, P4; P2
    ),
    Mutant(
        "pad-minus-one-mlp-sync-pads-row-zero",
        "under vLLM's convention the eager MLP-sync padding gives the padded lanes row 0 instead of the pad request: a "
        "short DP group's eager pass writes the padded tokens' KV into the request that holds row 0",
        "padding value of the other convention",
        ((mlp_sync, "prepare_mlp_sync_batch", Wrap(_mlp_sync_pads_row_zero)),),
        (PAD_MINUS_ONE,),  # P3, P4 (eager side)
    ),
    Mutant(
        "ragged-gather-index-tail-stale",
        "the ragged replay fill writes the last-token gather index of the live lanes only: a padded lane keeps a larger "
        "batch's absolute row, names a live token, and the body scatters the padded lane's proposal over that token's "
        "next id",
        "stale padded lane after shrink",
        ((RaggedPlan, "padded", Wrap(_padded_without_index)),),
        (RAGGED,),  # P3, P4 (P1 and P2 check the index too)
    ),
    Mutant(
        "ragged-unowned-tokens-write-through-lane",
        "the ragged body looks every token's KV slot up through its lane's request row, the bucket's tokens past every "
        "lane's extent included: they sit behind the last lane and write its request's position-0 slot",
        "KV write for padded rows lands in a live slot",
        ((ragged_draft_extend, "ragged_write_slots", _slots_through_lane),),
        (RAGGED,),
    ),
    Mutant(
        "piecewise-attention-padded-count",
        "the PIECEWISE attention is built for the padded bucket instead of the live requests: it runs the lanes past "
        "them, stale from a larger batch, whose KV writes land in their old requests' slots",
        "metadata built for the padded count",
        ((PiecewiseDraftExtendCudaGraphRunner, "_fill_for_replay", Wrap(_attention_for_bucket)),),
        (PIECEWISE,),  # P1 (the attention batch), P3, P4
    ),
    Mutant(
        "piecewise-dense-counts-live",
        "the PIECEWISE dense pieces' gathered token counts are filled with the live count instead of the padded one the "
        "pieces were captured with",
        "metadata built for the live count",
        ((PiecewiseDraftExtendCudaGraphRunner, "_fill_for_replay", Wrap(_dense_counts_live)),),
        (PIECEWISE,),  # P1 (I1, fill)
    ),
    Mutant(
        "piecewise-token-count-not-padded",
        "the PIECEWISE dispatcher does not pad the token count to a captured size: a batch of any other count finds no "
        "graph and runs eagerly",
        "token count not padded to the capture size",
        ((PiecewiseDraftExtendCudaGraphRunner, "padded_num_tokens", _not_padded),),
        (PIECEWISE,),  # P1 (bucket rules), P3 (eager fallbacks)
    ),
)
