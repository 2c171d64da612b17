"""Reference attention over the paged KV cache, written with static shapes only.

Every token reads its request's keys through a page table built from its req_to_token
row (the slot of each page's first position, divided by page_size), as paged kernels do,
and masks keys by `key_pos < seq_len` and `key_pos <= position`; a TARGET_VERIFY batch with a
tree (`EagleVerifyInput`) masks the keys of its own nodes by the tree mask instead
(`tree_key_mask`); a single-layer draft decode step reads the prefix and the lane's own draft
slots (`init_draft_decode_metadata`). No host syncs, no data-dependent shapes:
the same code runs eagerly and under a CUDA graph, and the padded lanes (seq_len = fill,
position 0, padding slot) are computed like any other lane.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runners.batch import EagleVerifyInput, ForwardBatch
from runners.memory import ReqToTokenPool, TokenToKVPool


@dataclass
class AttnMetadata:
    token_to_req: torch.Tensor  # [N] request lane of each token
    kv_slots: torch.Tensor  # [N, max_ctx] KV slot of each key position, per token
    key_mask: torch.Tensor  # [N, max_ctx] bool


def token_to_request(fb: ForwardBatch) -> torch.Tensor:
    """[N] lane of each token, from extend_start_loc alone (static shapes: graph-safe)."""
    tok = torch.arange(fb.input_ids.shape[0], device=fb.input_ids.device)
    return (torch.searchsorted(fb.extend_start_loc, tok, right=True) - 1).clamp_(min=0)


def cache_positions(fb: ForwardBatch, token_to_req: torch.Tensor) -> torch.Tensor:
    """[N] the req_to_token column of each token's KV: its position, except in a tree verify,
    where node i of a lane lives at the root's position + i (siblings share a position, not a slot)."""
    if not isinstance(fb.spec_info, EagleVerifyInput):
        return fb.positions
    lane_start = fb.extend_start_loc[token_to_req]
    node = torch.arange(fb.positions.shape[0], device=fb.positions.device) - lane_start
    return fb.positions[lane_start] + node


def tree_key_mask(fb: ForwardBatch, token_to_req: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """[N, C] bool: the prefix (below the root's position) and, of the lane's own nodes, those the
    tree mask gives (a padded lane: root position 0, so only its own nodes, behind seq_len's bound).
    The node index is not clamped: a lane of other than T tokens has no mask rows for its extra
    nodes, and reading them must fail here as the kernel's read past the mask would on a GPU."""
    T = fb.spec_info.draft_token_num
    lane_start = fb.extend_start_loc[token_to_req]
    node = torch.arange(fb.positions.shape[0], device=fb.positions.device) - lane_start
    rel = key_pos[None, :] - fb.positions[lane_start][:, None]  # key column - root position
    bits = fb.spec_info.custom_mask[token_to_req[:, None], node[:, None], rel.clamp(0, T - 1)]
    return (rel < 0) | ((rel < T) & bits)


class TorchAttnBackend:
    name = "torch"

    def __init__(self, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool):
        self.req_pool = req_pool
        self.kv_pool = kv_pool

    def init_forward_metadata(self, fb: ForwardBatch) -> AttnMetadata:
        token_to_req = token_to_request(fb)
        ps = self.kv_pool.page_size
        page_table = self.req_pool.req_to_token[fb.req_pool_indices, ::ps] // ps  # [bs, ceil(C / ps)]
        key_pos = torch.arange(self.req_pool.req_to_token.shape[1], device=page_table.device)
        kv_slots = page_table[token_to_req][:, key_pos // ps] * ps + key_pos % ps  # [N, C]
        seq_len = fb.seq_lens[token_to_req]
        if isinstance(fb.spec_info, EagleVerifyInput):
            visible = tree_key_mask(fb, token_to_req, key_pos)
        else:
            visible = key_pos[None, :] <= fb.positions[:, None]
        key_mask = (key_pos[None, :] < seq_len[:, None]) & visible
        return AttnMetadata(token_to_req, kv_slots, key_mask)

    def init_draft_decode_metadata(self, fb: ForwardBatch, locs: torch.Tensor, step: int) -> AttnMetadata:
        """Draft step `step` of a single-layer draft decode (locs [bs, topk, steps]: every lane's draft slots): lane (b, t)
        reads request b's prefix (its req_to_token row below seq_len) then its own slot column of steps 0..step, as the
        engine's multi-step draft backends build one kv_indices per step; its tree ancestors are not what it reads."""
        bs, topk, steps = locs.shape
        n = bs * topk
        lane_req = torch.arange(n, device=locs.device) // topk
        prefix = self.req_pool.req_to_token[fb.req_pool_indices][lane_req]  # [N, C]
        key_pos = torch.arange(prefix.shape[1], device=prefix.device)
        prefix_mask = key_pos[None, :] < fb.seq_lens[lane_req][:, None]
        draft_mask = (torch.arange(steps, device=prefix.device) <= step)[None, :].expand(n, steps)
        return AttnMetadata(lane_req, torch.cat([prefix, locs.reshape(n, steps)], dim=1), torch.cat([prefix_mask, draft_mask], dim=1))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch, meta: AttnMetadata) -> torch.Tensor:
        """q [N, hq, d], k/v [N, hkv, d] (this pass's tokens) -> [N, hq, d]."""
        self.kv_pool.write(layer, fb.out_cache_loc, k, v)
        return attend(q, self.kv_pool.k[layer], self.kv_pool.v[layer], meta.kv_slots, meta.key_mask)

    @staticmethod
    def masked_values(vals: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """A masked key has probability 0, but 0 * NaN = NaN: zero masked values so no masked slot
        (the padding slot, a freed or stale one) reaches a real row, as a kernel that skips them."""
        return vals.masked_fill(~key_mask[:, :, None, None], 0)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_slots: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    """Row n of q [N, hq, d] over the cache slots kv_slots[n] [C] where key_mask[n] holds: one softmax in fp32, GQA by
    repeating the KV heads."""
    keys, vals = k_cache[kv_slots], v_cache[kv_slots]  # [N, C, hkv, d]
    group = q.shape[1] // keys.shape[2]
    keys = keys.repeat_interleave(group, dim=2).to(q.dtype)
    vals = vals.repeat_interleave(group, dim=2).to(q.dtype)
    scores = torch.einsum("nhd,nchd->nhc", q, keys) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~key_mask[:, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.einsum("nhc,nchd->nhd", probs, TorchAttnBackend.masked_values(vals, key_mask))
