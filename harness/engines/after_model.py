"""Past the model call: a deterministic stand-in model, and what the engine does with its output.

The draft model is never run. Where the adapter drives a step body past the model call, the
model call returns what the stand-in below computes, so the engine's own code after it runs
on known values: the logits processor's row selection (which rows reach lm_head), the step
body's select_index and top-k, and the next step's input writes of the draft chain.

The stand-in: hidden row r carries the token fed at row r (input_ids[r]) in column 0 (the rest
is seeded noise, so nothing may depend on it), and its lm_head maps a hidden row to logits
peaked at one token, next_token(x) = SEED + 37 x mod VOCAB (37 odd: injective on any VOCAB
consecutive ids, and the live batch's ids in one iteration are consecutive). A top-k that read
the wrong row, or a chain write that moved the drafted token, shows as a wrong token.

What the engine must produce, written from DRAFT_EXTEND_V2 (a fixed window of T tokens per
request: docs/properties.md, I5) and the runner sources, not computed by the engine code under test:

* a request's window at step 0 is its T rows [i·T, (i+1)·T); its last accepted token sits at
  offset num_correct_drafts[i] (the front tokens, none here, come first);
* releases whose step windows grow by a token per step (width W_s = W_0 + s: each step
  appends the token it drafted) move that row by the s tokens appended: row
  i·W_s + num_correct_drafts[i] + s; releases with one width for all steps rotate the chain
  on the worker, so the row stays at i·W + num_correct_drafts[i];
* where the worker rotates (before step s + 1, with step s's top-k), each request's window
  drops its first token and the drafted token takes the last accepted row: rows
  i·W .. i·W + num_correct_drafts[i] of step s + 1 hold rows i·W + 1 .. i·W +
  num_correct_drafts[i] of step s, then the token step s drafted (the rows after it are
  rejected drafts, read by nothing that is kept);
* step s drafts top-k of that row's logits: topk_index[i][0] = next_token(input_ids[row(i, s)]),
  input_ids as the graph launched with them (step 0's real rows are checked against the live
  batch by lanes.py; later steps' by the chain rule below);
* where the windows grow, the chain advances inside the graph (step s's body writes step
  s + 1's inputs): step s + 1's input_ids hold the token step s drafted at its own
  row(i, s + 1) when step s + 1 launches;
* logits handed back: a runner that prunes (one row per request) hands back, for request i,
  the logits of row(i, s); one that does not hands back row k's logits as row k;
* I6 on what was selected: the single-layer runner and the multi-layer runner's step 0 see
  the same batch and must take each request's logits from the same token (its last accepted
  one), whichever of them prunes; each is also held to the rule above, so a disagreement
  fails on the runner that departs from it (check.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from harness.verdict import Verdict

SEED = 20261203
VOCAB = 128  # >= the most token rows a batch has (16 requests x width 6): next_token is injective on one batch's ids
_STRIDE = 37  # odd: x -> SEED + 37 x is a bijection mod a power of two


def next_token(x: int) -> int:
    return (SEED + _STRIDE * x) % VOCAB


def hidden_rows(input_ids: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """The stand-in model's hidden states: the token fed at each row in column 0, seeded noise elsewhere."""
    n = int(input_ids.shape[0])
    g = torch.Generator().manual_seed(SEED + n)
    h = torch.rand(n, hidden_size, generator=g)
    h[:, 0] = input_ids.to(h.dtype)
    return h


def lm_head(hidden: torch.Tensor) -> torch.Tensor:
    """Logits peaked at next_token(the id a hidden row carries): -(v - token)^2, a unique maximum."""
    tokens = torch.tensor([next_token(int(r)) for r in hidden[:, 0].tolist()], dtype=torch.float32)
    vocab = torch.arange(VOCAB, dtype=torch.float32)
    return -((vocab[None, :] - tokens[:, None]) ** 2)


@dataclass
class BodyRecord:
    """What one replay's step body produced past the model call, as a list of ints per output."""

    runner: str
    step: int
    raw_bs: int
    bs: int
    tokens_per_bs: int  # W_s, this runner's window per request
    base_width: int  # W_0, step 0's window
    pruned: bool  # the logits handed back are one row per request
    returned_tokens: list[int]  # argmax of each logits row handed back after replay
    topk_index: Optional[list[int]]  # the body's top-1 per request (None: the body computes no top-k)
    input_ids: list[int]  # this runner's input_ids buffer when its graph launched
    rotated: bool = False  # the worker rotated the window since the previous step launched (build.py)


def selected_row(i: int, ncd: int, width: int, base_width: int, step: int) -> int:
    """Request i's last accepted row at a step (module doc): grown windows shift it by the tokens appended."""
    return i * width + ncd + (width - base_width)


def check_body(v: Verdict, rec: BodyRecord, ncd: list[int], prev: Optional[BodyRecord], where: dict) -> None:
    """One replay's body against the rules of the module doc; prev: step s - 1's body of the same runner."""
    prev_topk = None if prev is None else prev.topk_index
    W, W0, s = rec.tokens_per_bs, rec.base_width, rec.step
    rows = [selected_row(i, ncd[i], W, W0, s) for i in range(rec.raw_bs)]
    content = [rec.input_ids[r] for r in rows]
    want_returned = [next_token(x) for x in (content if rec.pruned else rec.input_ids[: rec.raw_bs * W])]
    v.checked += 1
    if rec.returned_tokens != want_returned:
        k = _first_diff(rec.returned_tokens, want_returned)
        v.fail("select", "returned logits", {**where, "row": k}, _at(want_returned, k), _at(rec.returned_tokens, k),
               "the logits handed back after replay, as the token they peak at: " + (
                   "one row per request, from its last accepted row" if rec.pruned else "every token row, in order"))
    if rec.topk_index is not None:
        want = [next_token(x) for x in content]
        got = rec.topk_index[: rec.raw_bs]
        v.checked += 1
        if got != want:
            i = _first_diff(got, want)
            v.fail("select", "topk_index", {**where, "request": i}, want[i], _at(got, i),
                   f"top-1 of the logits of request {i}'s last accepted row {rows[i]} (i*W + num_correct_drafts + grown, W={W}): select_index")
    if s > 0 and W - W0 == s and prev_topk is not None:  # a grown window: the previous step's body wrote this one
        want = prev_topk[: rec.raw_bs]
        v.checked += 1
        if content != want:
            i = _first_diff(content, want)
            v.fail("chain", "input_ids", {**where, "request": i, "row": rows[i]}, want[i], content[i],
                   f"the token step {s - 1} drafted, written by its body at this step's last accepted row of request {i}")
    if s > 0 and rec.rotated and prev is not None and prev_topk is not None:
        _check_rotated(v, rec, ncd, prev, where)


def _check_rotated(v: Verdict, rec: BodyRecord, ncd: list[int], prev: BodyRecord, where: dict) -> None:
    """The worker's rotation (module doc), request by request, on the rows up to the last accepted one."""
    W = rec.tokens_per_bs
    for i in range(rec.raw_bs):
        lo, hi = i * W, i * W + ncd[i]
        want = prev.input_ids[lo + 1: hi + 1] + [prev.topk_index[i]]
        got = rec.input_ids[lo: hi + 1]
        v.checked += 1
        if got != want:
            k = _first_diff(got, want)
            v.fail("chain", "input_ids", {**where, "request": i, "row": lo + k}, _at(want, k), _at(got, k),
                   f"the worker's rotation before step {rec.step}: request {i}'s window moved up a row, the token step "
                   f"{rec.step - 1} drafted at its last accepted row {hi}")
            return


def selected_tokens(rec: BodyRecord, ncd: list[int]) -> list[int]:
    """Per real request, the token its selected logits peak at (I6 compares these): the body's top-1 where the body
    selects (the multi-layer step body), else the handed-back logits of its last accepted row."""
    if rec.topk_index is not None:
        return rec.topk_index[: rec.raw_bs]
    if rec.pruned:
        return rec.returned_tokens[: rec.raw_bs]
    rows = [selected_row(i, ncd[i], rec.tokens_per_bs, rec.base_width, rec.step) for i in range(rec.raw_bs)]
    return [rec.returned_tokens[r] if r < len(rec.returned_tokens) else -1 for r in rows]


def _first_diff(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _at(xs: list, i: int):
    return xs[i] if i < len(xs) else "absent"
