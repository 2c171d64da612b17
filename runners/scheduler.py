"""Requests and their paged KV bookkeeping, and who runs: arrive, finish, preempt.

One `KVBook` per rank owns the page allocator and the request-to-token map that the target
and the draft share (as the engine's target and draft workers do): position p of a request
lives in slot `req.slots[p]` of every KV pool, target layers and draft layers alike, at
offset p % page_size of the request's (p // page_size)-th page. Page 0 (with the padding
slot) and request row 0 are never handed out: padded graph lanes use them.

Pages are allocated on demand and freed as soon as they hold nothing the request still
needs (the pages past the last kept position after each round). The free lists are stacks,
the most recently freed page and row handed out first, so a finished request's memory
belongs to another request at once: a stale write into a slot that moved on shows (with
FIFO reuse over a long free list it would land in a slot nobody holds and stay latent).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from runners.memory import PADDING_SLOT, PageAllocator, ReqToTokenPool, page_slots, pages_of


@dataclass
class Proposal:
    """A draft's guess for the next positions: the top-1 chain and every depth's top-k ids."""

    tokens: list[int]  # depth 1..S: the chain the next draft step was fed (top-1 of each step)
    candidates: list[list[int]]  # per depth, the top-k ids; candidates[k][0] == tokens[k]


@dataclass
class Request:
    rid: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    dp_rank: int = 0  # the DP attention group that serves it
    tokens: list[int] = field(default_factory=list)  # prompt + committed output
    req_pool_idx: Optional[int] = None
    slots: list[int] = field(default_factory=list)  # slots[p]: the KV slot of position p (its pages: pages_of(slots))
    proposal: Optional[Proposal] = None
    accept_lens: list[int] = field(default_factory=list)  # per verify round: tokens committed, 1..T
    sibling_accepts: list[bool] = field(default_factory=list)  # per round: the last accepted draft was a top-k sibling
    status: str = "new"  # new | running | waiting | finished
    preemptions: int = 0
    return_logprob: bool = False  # SGLang's sampling params: the committed tokens' target logprobs (runners.logprobs) ...
    top_logprobs_num: int = 0  # ... and, at each output position, the top_logprobs_num likeliest tokens
    output_token_logprobs: list[float] = field(default_factory=list)  # per committed output token
    output_top_logprobs_idx: list[list[int]] = field(default_factory=list)  # per committed output token (top_logprobs_num > 0)
    output_top_logprobs_val: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.num_generated

    @property
    def has_kv(self) -> bool:
        return self.req_pool_idx is not None


class KVBook:
    """Page and request-row bookkeeping for one rank, for KV pools of `num_slots` slots."""

    def __init__(self, req_pool: ReqToTokenPool, num_slots: int, page_size: int = 1):
        self.req_pool, self.num_slots = req_pool, num_slots
        self.allocator = PageAllocator(num_slots, page_size)
        self.page_size = page_size
        self.max_context_len = req_pool.req_to_token.shape[1]

    def admit(self, req: Request) -> None:
        req.req_pool_idx = self.req_pool.alloc()
        req.slots = []

    def ensure(self, req: Request, num_positions: int) -> None:
        """Slots for positions [0, num_positions), new pages as needed."""
        have = len(req.slots)
        if num_positions > self.max_context_len:
            raise RuntimeError(f"request {req.rid}: {num_positions} positions exceed max_context_len {self.max_context_len}")
        if num_positions <= have:
            return
        pages = pages_of(req.slots, self.page_size)
        pages += self.allocator.alloc(self.allocator.pages_for(num_positions) - len(pages))
        new = page_slots(pages, num_positions, self.page_size)[have:]
        row = self.req_pool.req_to_token[req.req_pool_idx]
        row[have:num_positions] = torch.tensor(new, dtype=row.dtype, device=row.device)
        req.slots.extend(new)

    def truncate(self, req: Request, num_positions: int) -> None:
        """Drop positions >= num_positions and free the pages past the last one kept (their row entries
        go stale, masked by seq_len)."""
        if len(req.slots) > num_positions:
            pages = pages_of(req.slots, self.page_size)
            self.allocator.release(pages[self.allocator.pages_for(num_positions):])
            del req.slots[num_positions:]

    def release(self, req: Request) -> None:
        if req.req_pool_idx is None:
            return
        self.allocator.release(pages_of(req.slots, self.page_size))
        self.req_pool.release(req.req_pool_idx)
        req.req_pool_idx, req.slots = None, []

    # ---- invariants (P8) ----
    def problems(self, live: list[Request]) -> list[str]:
        """Every slot owned once, never in the padding page; slots laid out by page; owned + free pages = all; rows match slots."""
        out = []
        ps = self.page_size
        owned: dict[int, int] = {}
        owned_pages: set[int] = set()
        for r in live:
            if r.req_pool_idx is None:
                out.append(f"request {r.rid} is running without a request row")
                continue
            row = self.req_pool.req_to_token[r.req_pool_idx, : len(r.slots)].tolist()
            if row != r.slots:
                out.append(f"request {r.rid}: req_to_token row {r.req_pool_idx} disagrees with its slots")
            pages = pages_of(r.slots, ps)
            if r.slots != page_slots(pages, len(r.slots), ps):
                out.append(f"request {r.rid}: slots are not laid out by page (page_size {ps})")
            owned_pages.update(pages)
            for p, s in enumerate(r.slots):
                if s // ps == PADDING_SLOT // ps:
                    out.append(f"request {r.rid} position {p} holds the padding slot's page")
                if s in owned:
                    out.append(f"slot {s} owned by requests {owned[s]} and {r.rid}")
                owned[s] = r.rid
        free = self.allocator.free
        if len(set(free)) != len(free):
            out.append("a page is free twice")
        both = owned_pages & set(free)
        if both:
            out.append(f"pages {sorted(both)[:5]} are owned and free at once")
        if len(owned_pages) + len(set(free)) != self.allocator.num_pages - 1:
            out.append(f"slot leak: {self.allocator.num_pages - 1} allocatable pages, {len(owned_pages)} owned + {len(set(free))} free")
        rows = [r.req_pool_idx for r in live if r.req_pool_idx is not None]
        if len(set(rows)) != len(rows):
            out.append(f"request rows shared: {rows}")
        if set(rows) & set(self.req_pool.free):
            out.append("a running request's row is on the free list")
        return out


class Scheduler:
    """The running batch of one DP group, in lane order, and the preempted requests waiting to resume."""

    def __init__(self, book: KVBook, max_running: int):
        self.book, self.max_running = book, max_running
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.finished: dict[int, Request] = {}

    def get(self, rid: int) -> Request:
        for r in self.running + self.waiting:
            if r.rid == rid:
                return r
        raise KeyError(f"request {rid} is neither running nor waiting")

    def add(self, req: Request) -> None:
        if len(self.running) >= self.max_running:
            raise RuntimeError(f"request {req.rid}: the batch is full ({self.max_running} running)")
        req.status = "running"
        self.running.append(req)

    def finish(self, rid: int) -> Request:
        req = self.get(rid)
        (self.running if req in self.running else self.waiting).remove(req)
        self.book.release(req)
        req.status, req.proposal = "finished", None
        self.finished[rid] = req
        return req

    def preempt(self, rid: int) -> Request:
        """Free its KV and request row; it keeps its tokens and is re-prefilled when resumed."""
        req = self.get(rid)
        self.running.remove(req)
        self.book.release(req)
        req.status, req.proposal = "waiting", None
        req.preemptions += 1
        self.waiting.append(req)
        return req

    def resume(self, rid: int) -> Request:
        req = self.get(rid)
        self.waiting.remove(req)
        self.add(req)
        return req
