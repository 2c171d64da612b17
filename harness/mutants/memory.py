"""Mutants of memory addressed as engines address it, and of non-unit norms: P2 / P5 / P6 kill these."""
from __future__ import annotations

import torch

from harness.mutants.base import Mutant, keeps
from harness.mutants.draft_extend import REAL_RESET

# ---- issue 20: memory addressed as engines address it; non-unit norms (P2 / P5 / P6 kill these) ----
from runners import memory as _memory
from runners import scheduler as _scheduler
from runners.attention.torch_ref import AttnMetadata, TorchAttnBackend, token_to_request
from runners.model import TargetModel
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import MultiLayerEagleDraftExtendCudaGraphRunner


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


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "stale-padded-req-pool-indices",
        "replay reset leaves req_pool_indices alone (the fill SGLang 0.5.23 added): after the batch shrinks, padded lanes keep the larger batch's request rows and the in-graph slot lookup writes their KV into slots those rows point at",
        "in-graph slot lookup through a stale row",
        ((MultiLayerEagleDraftExtendCudaGraphRunner, "reset_for_iteration", keeps(REAL_RESET, "req_pool_indices")),),
        ("padded-lanes-multi-layer", "padded-lanes"),  # P2: the stale rows route the padded lanes' KV writes (out_cache_loc) off the padding slot
    ),
    Mutant(
        "stale-padded-positions",
        "replay reset leaves positions alone: after the batch shrinks, padded lanes gather rotary rows and look write slots up at the larger batch's positions (harmless while their row is the padding row: only the fill check sees it)",
        "stale padded position",
        ((MultiLayerEagleDraftExtendCudaGraphRunner, "reset_for_iteration", keeps(REAL_RESET, "positions")),),
        ("padded-lanes-multi-layer", "padded-lanes"),  # P2 (canonical fill)
    ),
    Mutant(
        "target-hidden-after-final-norm",
        "the target hands the draft its hidden states after the final norm instead of before (invisible with unit norm weights: the draft's hnorm undoes a plain RMS normalisation)",
        "hidden state handed on after the norm",
        ((TargetModel, "forward", _target_hands_on_normed_hidden),),
        ("spec-cases:tp2_dp2_mlp_tp_gather-eager", "spec-cases", "draft-decode"),  # P6 (the acceptance golden; the draft-tree golden of the single-layer cases)
    ),
    Mutant(
        "truncate-frees-kept-page",
        "after a verify the KV book frees the pages past num_positions // page_size instead of past ceil(num_positions / page_size): the page holding the last kept positions goes back on the free list while the request still uses it (page_size > 1 only)",
        "allocator hands out a page still referenced",
        ((_scheduler.KVBook, "truncate", _truncate_frees_kept_page),),
        ("spec-cases:tp2_page4_tree", "spec-cases"),  # P5, P6: only the loop's paged cases reuse a freed page
    ),
    Mutant(
        "page-table-first-slots",
        "the attention page table is built from the first num_pages entries of each req_to_token row instead of every page_size-th: keys past the first page are read from the wrong pages (page_size > 1 only)",
        "page table built wrong",
        ((TorchAttnBackend, "init_forward_metadata", _page_table_first_slots),),
        ("spec-cases:tp2_page4_tree", "spec-cases", "draft-decode"),  # P5, P6 (the paged cases of the loop)
    ),
)
