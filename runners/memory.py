"""Request-to-token map, the paged KV pool of one rank, and the allocators that hand out both.

KV slots come in pages of `page_size` slots (slot = page * page_size + offset); position p
of a request lives at offset p % page_size of its (p // page_size)-th page, and its
req_to_token row holds that slot. Page 0 holds the padding slot (slot 0) and request row 0
is the padding row (every entry the padding slot): neither is ever handed out, so a padded
graph lane with the canonical fill (req_pool_indices 0, position 0) looks its KV write
location up as req_to_token[0, 0] = PADDING_SLOT.

Both allocators are stacks: the most recently freed request row and page are handed out
first, as the engine's free lists do. A padded lane holding a stale request row or position
then points at memory that already belongs to a live request, so a missing replay fill
corrupts live KV instead of landing in memory nobody holds.

That is SGLang's convention (a reserved dummy slot). Under vLLM's (runners.config.PaddingConvention)
no request row is reserved: a padded lane holds the pad request index PAD_REQUEST (-1), its
write slot is PAD_SLOT_ID (-1), and every KV write skips that slot (`TokenToKVPool.write`, as
vLLM's reshape_and_cache skips slot < 0); page 0 stays reserved and nothing writes it. What a
pad request's keys are read from reaches only its own rows: torch indexing wraps row -1 to the
last row, in bounds; the triton kernels, which address rows by pointer, read the null slot 0
instead (as vLLM zeroes a padded lane's block-table row), to stay inside req_to_token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from runners.config import PaddingConvention

PADDING_SLOT = 0
PADDING_ROW = 0
PAD_SLOT_ID = -1  # vLLM's PAD_SLOT_ID: a write slot every KV write skips
PAD_REQUEST = -1  # vLLM's idx_mapping value of a padded (dummy) request: it owns no row, its tokens write PAD_SLOT_ID


@dataclass(frozen=True)
class LanePadding:
    """What a graph runner's replay fill (and the eager MLP-sync padding) gives a padded lane under a convention."""

    row: int  # req_pool_indices: the padding row (SGLang) or the pad request -1 (vLLM)
    slot: int  # out_cache_loc: the dummy slot (SGLang) or PAD_SLOT_ID (vLLM)


def lane_padding(convention: PaddingConvention) -> LanePadding:
    if PaddingConvention(convention) is PaddingConvention.VLLM_PAD_MINUS_ONE:
        return LanePadding(PAD_REQUEST, PAD_SLOT_ID)
    return LanePadding(PADDING_ROW, PADDING_SLOT)


def check_page_size(page_size: int) -> None:
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two >= 1, got {page_size!r}")


def page_slots(pages: list[int], num_positions: int, page_size: int) -> list[int]:
    """The slots of positions 0 .. num_positions-1 of a request holding `pages` in order."""
    return [pages[p // page_size] * page_size + p % page_size for p in range(num_positions)]


def pages_of(slots: list[int], page_size: int) -> list[int]:
    """The distinct pages of `slots`, in first-seen order."""
    return list(dict.fromkeys(s // page_size for s in slots))


class PageAllocator:
    """KV pages of one slot index space; page 0 (the padding slot's) is never handed out."""

    def __init__(self, num_slots: int, page_size: int = 1):
        check_page_size(page_size)
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.free = list(range(self.num_pages - 1, 0, -1))  # a stack: page 1 first, then the most recently freed

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"KV pages exhausted: need {n}, {len(self.free)} free (page_size {self.page_size})")
        return [self.free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        """The first page of `pages` is the next one handed out."""
        self.free.extend(reversed(pages))

    def pages_for(self, num_positions: int) -> int:
        return -(-num_positions // self.page_size)


class ReqToTokenPool:
    """The request map, and the padding convention its rows follow: SGLang's reserves row 0 as the padding row, vLLM's
    none (`pad_slot`: the write slot of a pad request's tokens, for write_slots)."""

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device,
                 padding: PaddingConvention = PaddingConvention.SGLANG_DUMMY_SLOT):
        self.req_to_token = torch.full((max_reqs, max_context_len), PADDING_SLOT, dtype=torch.int64, device=device)
        self.padding = PaddingConvention(padding)
        self.minus_one = self.padding is PaddingConvention.VLLM_PAD_MINUS_ONE
        self.pad_slot: Optional[int] = PAD_SLOT_ID if self.minus_one else None  # write_slots' pad_slot: None, no pad request
        first = 0 if self.minus_one else PADDING_ROW + 1  # SGLang reserves row 0 as the padding row; vLLM reserves none
        self.free = list(range(max_reqs - 1, first - 1, -1))  # a stack, like PageAllocator

    def alloc(self) -> int:
        if not self.free:
            raise RuntimeError("request pool exhausted")
        return self.free.pop()

    def release(self, idx: int) -> None:
        """The row is handed out next; its entries stay (stale) until its next owner writes them."""
        self.free.append(idx)


class TokenToKVPool:
    """One K and one V tensor per layer: [num_slots, local_kv_heads, head_dim], handed out in pages."""

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 page_size: int = 1):
        # one spare row past the pool's end: where a write to PAD_SLOT_ID lands (`write`); k and v are views without it
        shape = (num_slots + 1, kv_heads, head_dim)
        self._stores = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2 * num_layers)]
        self.k = [t[:num_slots] for t in self._stores[:num_layers]]
        self.v = [t[:num_slots] for t in self._stores[num_layers:]]
        self.num_slots = num_slots
        self.allocator = PageAllocator(num_slots, page_size)
        self.page_size = page_size

    def alloc(self, n: int) -> list[int]:
        """Slots for positions 0 .. n-1 of one request (whole pages)."""
        return page_slots(self.allocator.alloc(self.allocator.pages_for(n)), n, self.page_size)

    def release(self, slots: list[int]) -> None:
        self.allocator.release(pages_of(slots, self.page_size))

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """K and V of every token at its slot; a token at PAD_SLOT_ID (-1) writes nothing (vLLM's reshape_and_cache
        returns on slot < 0). Graph-safe: the skip is a redirect into the spare row past the pool's end, which no slot
        index reaches, not a data-dependent shape."""
        skip = torch.where(loc < 0, self.num_slots, loc)
        num_layers = len(self.k)
        self._stores[layer].index_copy_(0, skip, k.to(self.k[layer].dtype))
        self._stores[num_layers + layer].index_copy_(0, skip, v.to(self.v[layer].dtype))


def write_slots(req_to_token: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, pad_slot: Optional[int] = None) -> torch.Tensor:
    """req_to_token[rows, cols] (broadcast): the KV write slots. pad_slot given (vLLM's convention): a pad request's
    (row -1) slots are pad_slot, never a row's entry; None: every row is a request row (SGLang's padded lanes hold the
    padding row, whose entries are the dummy slot)."""
    if pad_slot is None:
        return req_to_token[rows, cols]
    return torch.where(rows < 0, pad_slot, req_to_token[rows.clamp(min=0), cols])


def assign_out_cache_loc(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, positions: torch.Tensor,
                         token_to_req: torch.Tensor, out: torch.Tensor, pad_slot: Optional[int] = None) -> torch.Tensor:
    """KV write location of every token, req_to_token[req_pool_indices[lane], position], into `out`.

    Runs inside the step body (graph-safe: gathers only), so a padded lane's write location
    is whatever its request row and position point at: the replay fill (row 0, position 0)
    makes it the padding slot; under vLLM's convention (pad_slot = PAD_SLOT_ID) the fill's
    pad request (-1) makes it PAD_SLOT_ID.
    """
    return out.copy_(write_slots(req_to_token, req_pool_indices[token_to_req], positions, pad_slot))
