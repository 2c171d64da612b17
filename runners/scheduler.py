"""Requests and their paged KV bookkeeping (page size 1), and who runs: arrive, finish, preempt.

One `KVBook` per rank owns the slot allocator and the request-to-token map that the target
and the draft share (as the engine's target and draft workers do): position p of a request
lives in slot `req.slots[p]` of every KV pool, target layers and draft layers alike. Slot 0
(the padding slot) and request row 0 are never handed out: padded graph lanes use them.

Slots are allocated per position on demand and freed as soon as they hold nothing the
request still needs (the rejected draft positions after each round). The free list is a
stack, the most recently freed slot handed out first, so a finished request's slots belong
to another request at once: a stale write into a slot that moved on shows (with FIFO reuse
over a long free list it would land in a slot nobody holds and stay latent).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from runners.memory import PADDING_SLOT, ReqToTokenPool


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
    slots: list[int] = field(default_factory=list)  # slots[p]: the KV slot of position p
    proposal: Optional[Proposal] = None
    accept_lens: list[int] = field(default_factory=list)  # per verify round: tokens committed, 1..T
    sibling_accepts: list[bool] = field(default_factory=list)  # per round: the last accepted draft was a top-k sibling
    status: str = "new"  # new | running | waiting | finished
    preemptions: int = 0

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
    """Slot and request-row bookkeeping for one rank, for KV pools of `num_slots` slots."""

    def __init__(self, req_pool: ReqToTokenPool, num_slots: int):
        self.req_pool, self.num_slots = req_pool, num_slots
        self.free = list(range(num_slots - 1, PADDING_SLOT, -1))  # a stack: slot 1 first, then the most recently freed
        self.max_context_len = req_pool.req_to_token.shape[1]
        self.scratch: dict[int, list[int]] = {}  # scratch row -> slots it holds (tree verification)

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"KV slots exhausted: need {n}, {len(self.free)} free")
        return [self.free.pop() for _ in range(n)]

    def free_slots(self, slots: list[int]) -> None:
        self.free.extend(reversed(slots))

    def admit(self, req: Request) -> None:
        req.req_pool_idx = self.req_pool.alloc()
        req.slots = []

    def ensure(self, req: Request, num_positions: int) -> None:
        """Slots for positions [0, num_positions)."""
        have = len(req.slots)
        if num_positions > self.max_context_len:
            raise RuntimeError(f"request {req.rid}: {num_positions} positions exceed max_context_len {self.max_context_len}")
        if num_positions <= have:
            return
        new = self.alloc(num_positions - have)
        row = self.req_pool.req_to_token[req.req_pool_idx]
        row[have:num_positions] = torch.tensor(new, dtype=row.dtype, device=row.device)
        req.slots.extend(new)

    def truncate(self, req: Request, num_positions: int) -> None:
        """Free the slots of positions >= num_positions (their row entries go stale, masked by seq_len)."""
        if len(req.slots) > num_positions:
            self.free_slots(req.slots[num_positions:])
            del req.slots[num_positions:]

    def replace_slot(self, req: Request, pos: int, slot: int) -> None:
        """Position `pos` now lives in `slot` (an accepted tree node's KV); its old slot is freed."""
        self.free_slots([req.slots[pos]])
        req.slots[pos] = slot
        self.req_pool.req_to_token[req.req_pool_idx, pos] = slot

    def release(self, req: Request) -> None:
        if req.req_pool_idx is None:
            return
        self.free_slots(req.slots)
        self.req_pool.release(req.req_pool_idx)
        req.req_pool_idx, req.slots = None, []

    # ---- scratch rows: a copy of a request's row with one position redirected (tree siblings) ----
    def scratch_row(self, req: Request, pos: int) -> tuple[int, int]:
        """A request row for a sibling node at `pos`: the request's slots below pos, a fresh slot at pos."""
        idx = self.req_pool.alloc()
        (slot,) = self.alloc(1)
        row = self.req_pool.req_to_token
        row[idx, :pos] = row[req.req_pool_idx, :pos]
        row[idx, pos] = slot
        self.scratch[idx] = [slot]
        return idx, slot

    def drop_scratch(self, keep: set[int] = frozenset()) -> None:
        """Release every scratch row; slots in `keep` (adopted by a request) stay allocated."""
        for idx, slots in self.scratch.items():
            self.free_slots([s for s in slots if s not in keep])
            self.req_pool.release(idx)
        self.scratch.clear()

    # ---- invariants (P8) ----
    def problems(self, live: list[Request]) -> list[str]:
        """Every slot owned once, never the padding slot; owned + free = all; rows match slots."""
        out = []
        owned: dict[int, int] = {}
        for r in live:
            if r.req_pool_idx is None:
                out.append(f"request {r.rid} is running without a request row")
                continue
            row = self.req_pool.req_to_token[r.req_pool_idx, : len(r.slots)].tolist()
            if row != r.slots:
                out.append(f"request {r.rid}: req_to_token row {r.req_pool_idx} disagrees with its slots")
            for p, s in enumerate(r.slots):
                if s == PADDING_SLOT:
                    out.append(f"request {r.rid} position {p} holds the padding slot")
                if s in owned:
                    out.append(f"slot {s} owned by requests {owned[s]} and {r.rid}")
                owned[s] = r.rid
        free = self.free
        if len(set(free)) != len(free):
            out.append("a slot is free twice")
        both = owned.keys() & set(free)
        if both:
            out.append(f"slots {sorted(both)[:5]} are owned and free at once")
        if len(owned) + len(set(free)) != self.num_slots - 1:
            out.append(f"slot leak: {self.num_slots - 1} allocatable, {len(owned)} owned + {len(set(free))} free")
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
