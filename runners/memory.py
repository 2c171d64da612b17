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
"""
from __future__ import annotations

import torch

PADDING_SLOT = 0
PADDING_ROW = 0


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
    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device):
        self.req_to_token = torch.full((max_reqs, max_context_len), PADDING_SLOT, dtype=torch.int64, device=device)
        self.free = list(range(max_reqs - 1, PADDING_ROW, -1))  # a stack, like PageAllocator; row 0 is the padding row

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
        shape = (num_slots, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.allocator = PageAllocator(num_slots, page_size)
        self.page_size = page_size

    def alloc(self, n: int) -> list[int]:
        """Slots for positions 0 .. n-1 of one request (whole pages)."""
        return page_slots(self.allocator.alloc(self.allocator.pages_for(n)), n, self.page_size)

    def release(self, slots: list[int]) -> None:
        self.allocator.release(pages_of(slots, self.page_size))

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, loc, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(0, loc, v.to(self.v[layer].dtype))


def assign_out_cache_loc(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, positions: torch.Tensor,
                         token_to_req: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """KV write location of every token, req_to_token[req_pool_indices[lane], position], into `out`.

    Runs inside the step body (graph-safe: gathers only), so a padded lane's write location
    is whatever its request row and position point at: the replay fill (row 0, position 0)
    makes it the padding slot.
    """
    return out.copy_(req_to_token[req_pool_indices[token_to_req], positions])
