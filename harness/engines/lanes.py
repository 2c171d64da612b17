"""The live batch engine-check replays, and P2's canonical-fill check on the engine's padded lanes.

At every replay an adapter snapshots the buffers the graph reads, whole (LaneRecord): the
per-request ones (req_pool_indices, seq_lens, num_correct_drafts, num_accept_tokens) and
the per-token ones (input_ids, positions, out_cache_loc). Two checks, per fill path:

* real rows: rows [:raw_bs] (tokens [:raw_bs * T]) hold exactly the live batch;
* canonical padded lanes: the replay fill exists so that the padded lanes [raw_bs, bs) (and
  tokens [raw_bs * T, bs * T)) do not depend on what ran before. The schedule replays every
  raw batch size twice, growing (its padded lanes were only ever padding) and shrinking
  (they last held a larger batch's real rows); each padded lane must read the same both
  times, in every buffer the release's own fill writes (FILLED_SINCE: which release began
  filling which buffer, per runner, from the release sources). A buffer a release leaves
  stale by design is reported as a note with its lanes, not hidden;
* padded values: history independence passes a fill that writes the same wrong value every time.
  The index buffers a fill writes must hold the one value that points nowhere live (PAD_VALUE).

Live values are distinct per iteration (and never the fill values), so a stale lane shows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from harness.props.poison import P2
from harness.verdict import Verdict
from runners.parallel.layout import ParallelLayout

PER_REQUEST = ("req_pool_indices", "seq_lens", "num_correct_drafts", "num_accept_tokens", "select_index")
PER_TOKEN = ("input_ids", "positions", "out_cache_loc")


def schedule(layout: ParallelLayout, capture_bs: list[int]) -> list[list[int]]:
    """Per iteration, each DP group's raw batch size: both ends of every bucket (the smallest batch it
    takes and a full one), growing then shrinking (so a smaller batch follows a larger one and finds
    its stale lanes). In the MLP-TP branch the bucket follows the largest group: each size also runs
    with each group in turn the small one. Every group runs the same schedule: the logits gather
    meets all groups' launches of one iteration."""
    edges = sorted(set(capture_bs))
    sizes = sorted({b for b in edges} | {a + 1 for a in [0, *edges[:-1]]})
    dp = layout.attn_dp_size
    out = []
    for r in sizes + sizes[::-1][1:]:
        out.append([r] * dp)
        if layout.require_mlp_tp_gather and dp > 1 and r > 1:
            out += [[1 if g == small else r for g in range(dp)] for small in range(dp)]
    return out



@dataclass
class LiveBatch:
    """One rank's raw batch at replay: sizes per DP group, this rank's lanes (values vary with the iteration)."""

    raw_bs: int
    dp_batch_sizes: list[int]
    seq_lens: list[int]
    accept_lens: list[int]
    req_pool_indices: list[int]
    iteration: int

    def tokens(self, T: int) -> dict[str, list[int]]:
        """The per-token inputs for a runner of width T: distinct per iteration, never 0."""
        n, it = self.raw_bs * T, self.iteration
        return {"input_ids": [3 + 101 * it + i for i in range(n)], "positions": [1 + it + i for i in range(n)],
                "out_cache_loc": [FIRST_LIVE_SLOT + 211 * it + i for i in range(n)]}

    @property
    def num_correct_drafts(self) -> list[int]:
        return [a - 1 for a in self.accept_lens]

    def requests(self, T: int) -> dict[str, list[int]]:
        """Per request; select_index is each request's last accepted row, i*T + num_correct_drafts (after_model.py)."""
        return {"select_index": [i * T + n for i, n in enumerate(self.num_correct_drafts)], "req_pool_indices": list(self.req_pool_indices),
                "seq_lens": list(self.seq_lens),
                "num_correct_drafts": self.num_correct_drafts, "num_accept_tokens": list(self.accept_lens)}


def live_batch(raw_bs: int, dp_batch_sizes: list[int], it: int, T: int, pool_size: int) -> LiveBatch:
    """Request rows 1.. (row 0 is the engine's reserved padding row), rotating with the iteration."""
    return LiveBatch(raw_bs, dp_batch_sizes, [5 + (3 * i + it) % 11 for i in range(raw_bs)], [1 + (i + it) % T for i in range(raw_bs)],
                     [1 + (i + it) % (pool_size - 1) for i in range(raw_bs)], it)


@dataclass
class LaneRecord:
    """The buffers one replay's graph would read, as one fill path left them."""

    runner: str
    step: int
    path: str  # "" (the runner's Python fill), "gpu" (the Triton kernel), "npu" (its native twin)
    raw_bs: int
    bs: int
    tokens_per_bs: int
    buffers: dict[str, Optional[list[int]]]


# (runner, buffer) -> the first release whose fill writes that buffer's padded lanes; absent: stale by design
# in every release checked. Read from the sources: the single-layer runner's replay resets its buffers
# whenever it pads (`if bs * w != num_tokens:`), req_pool_indices too from 0.5.14 on; the multi-layer
# composite's reset_buffers / prepare() and its fill kernel write seq_lens and the token buffers, and the
# kernel num_accept_tokens (= -1) from 0.5.16 on; they leave req_pool_indices and num_correct_drafts stale.
FILLED_SINCE: dict[tuple[str, str], str] = {
    ("single_layer", "seq_lens"): "0", ("single_layer", "positions"): "0", ("single_layer", "out_cache_loc"): "0",
    ("single_layer", "num_correct_drafts"): "0", ("single_layer", "num_accept_tokens"): "0",
    ("single_layer", "req_pool_indices"): "0.5.14",
    ("multi_layer", "seq_lens"): "0", ("multi_layer", "positions"): "0", ("multi_layer", "out_cache_loc"): "0",
    ("multi_layer", "input_ids"): "0", ("multi_layer", "num_accept_tokens"): "0.5.16",
    # the graphed draft decode's execute() resets seq_lens, positions and req_pool_indices whenever it pads
    ("draft_decode", "seq_lens"): "0", ("draft_decode", "positions"): "0", ("draft_decode", "req_pool_indices"): "0",
    # the target verify's replay fill (its buffer registry's padding policies): seq_lens to the fill value, req_pool_indices,
    # positions and out_cache_loc zeroed; input_ids only copied (its padded tail is not read)
    ("target_verify", "seq_lens"): "0", ("target_verify", "req_pool_indices"): "0", ("target_verify", "positions"): "0",
    ("target_verify", "out_cache_loc"): "0",
}


# The value a filled padded lane of an index buffer must hold: what the graph reads or writes through it must be
# nothing a live request owns. SGLang's KV pool and request pool reserve slot 0 and row 0 for padding (its verify
# buffer registry: padded rows "point at slot 0"), so out_cache_loc 0 makes a padded token's KV write a dummy one, and
# req_pool_indices 0 reads the padding row. Positions index the rotary cos/sin cache: 0 is in range for any model, a
# value past it a read out of bounds (SGLang issue 24361: stale padded positions, an illegal memory access in
# flashinfer's verify plan). seq_lens has its own fixed-value check (padded seq_lens = the fill value, p1_records).
# input_ids, num_correct_drafts and num_accept_tokens are absent: what a padded value may be there depends on how
# the step reads it (input_ids is not read past the live tokens; the accept counts index rows outside the graph).
PAD_VALUE: dict[str, int] = {"out_cache_loc": 0, "req_pool_indices": 0, "positions": 0}
PAD_MEANS = {"req_pool_indices": "reads the reserved padding row",
             "positions": "is in range of the rotary cache for any model (a stale position is a live request's, in range too, "
                          "but depends on the history)"}

# Where a padded token's KV write lands (out_cache_loc). SGLang's KV allocators hand out slots from page 1 on
# (TokenToKVPoolAllocator.clear / PagedTokenToKVPoolAllocator.clear: "the padded slot 0 is used for writing dummy
# outputs from padded tokens"), so at page size P the slots [0, P) -- page 0 -- are dummy space and a live request's
# slots start at P. Page size 1 is SGLang's default and the strictest (only slot 0 is dummy); the NPU defaults to 128
# (hardware_backend/npu/utils.py, set_default_server_args, when --page-size is not given), so the NPU path is checked at
# both. Independent of the page size: a padded row that holds a slot an earlier live batch was given (`stale slot`)
# writes its KV into a request's slot.
SLOT_BUFFER = "out_cache_loc"
STALE_SLOT = "stale slot"
PAGE_SIZES: dict[str, tuple[int, ...]] = {"": (1,), "gpu": (1,), "npu": (1, 128)}
# live requests' slots: past page 0 at every page size checked, distinct per iteration
FIRST_LIVE_SLOT = max(max(sizes) for sizes in PAGE_SIZES.values()) + 7


def check_lanes(v: Verdict, rec: LaneRecord, live: LiveBatch, seen: dict, where: dict, filled: frozenset[str]) -> None:
    """Real rows = the live batch; padded lanes of the buffers in `filled` independent of the history (see the module doc)."""
    T, raw, bs = rec.tokens_per_bs, rec.raw_bs, rec.bs
    want = {**live.requests(T), **live.tokens(T)}
    w = {**where, "path": rec.path or "python"} if rec.path else where
    for name in (*PER_REQUEST, *PER_TOKEN):
        buf = rec.buffers.get(name)
        if buf is None:
            continue
        real = want[name]
        v.checked += 1
        if buf[: len(real)] != real:
            i = next(i for i, (a, b) in enumerate(zip(buf, real, strict=False)) if a != b)
            v.fail("lanes", name, {**w, "row": i}, real[i], buf[i], "a real row after the replay fill: the live batch's value")
        lo, hi = (raw, bs) if name in PER_REQUEST else (raw * T, bs * T)
        pad = tuple(buf[lo:hi])
        if name in filled and name == SLOT_BUFFER and pad:
            _check_slots(v, rec, pad, lo, seen, w)
        elif name in filled and name in PAD_VALUE and pad:
            v.checked += 1
            bad = [i for i, x in enumerate(pad) if x != PAD_VALUE[name]]
            if bad:
                v.fail("pad value", name, {**w, "lane": lo + bad[0]}, PAD_VALUE[name], pad[bad[0]],
                       f"a padded {'lane' if name in PER_REQUEST else 'token row'} of a buffer the release's fill writes "
                       f"({len(bad)} of {len(pad)} padded); {PAD_VALUE[name]} {PAD_MEANS[name]}")
        key = (rec.runner, rec.step, rec.path, name, raw, bs, tuple(live.dp_batch_sizes))
        if key not in seen:
            seen[key] = (pad, live.iteration)
            continue
        first, first_it = seen[key]
        if pad == first:
            continue
        i = next(i for i, (a, b) in enumerate(zip(pad, first, strict=True)) if a != b)
        detail = (f"padded {'lane' if name in PER_REQUEST else 'token row'} {lo + i} holds {pad[i]} at iteration {live.iteration} "
                  f"(after a larger batch) and held {first[i]} the first time this raw_bs and bucket ran (iteration {first_it})")
        if name in filled:
            v.checked += 1
            v.fail("canonical", name, {**w, "lane": lo + i}, first[i], pad[i], f"the release's replay fill writes {name}: {detail}")
        elif ("noted", key[:4]) not in seen:  # once per (runner, step, path, buffer) and rank
            seen[("noted", key[:4])] = True
            v.notes.append(f"{P2}/canonical {name}: left stale by this release's fill (by design): {detail} "
                           f"[{', '.join(f'{k}={x}' for k, x in w.items())}]")
    if rec.buffers.get(SLOT_BUFFER) is not None:  # this batch's slots: a later padded row holding one writes into a request's slot
        owners = seen.setdefault(("slots", rec.runner, rec.step, rec.path), {})
        for row, slot in enumerate(want[SLOT_BUFFER]):
            owners.setdefault(slot, (live.iteration, row))


def _check_slots(v: Verdict, rec: LaneRecord, pad: tuple[int, ...], lo: int, seen: dict, w: dict) -> None:
    """The padded token rows of out_cache_loc: where each padded token's KV write lands (the module doc's `stale slot`)."""
    owners = seen.get(("slots", rec.runner, rec.step, rec.path), {})
    v.checked += 1
    stale = [(i, x) for i, x in enumerate(pad) if x in owners]
    if stale:
        i, x = stale[0]
        it, row = owners[x]
        v.fail(STALE_SLOT, SLOT_BUFFER, {**w, "lane": lo + i}, "a slot of the dummy page 0", x,
               f"padded token row {lo + i} holds slot {x}, which iteration {it}'s live batch gave its token row {row}: this padded "
               f"token's KV write lands in a slot a request was given, at any page size ({len(stale)} of {len(pad)} padded rows)")
    for page_size in PAGE_SIZES[rec.path]:
        v.checked += 1
        bad = [(i, x) for i, x in enumerate(pad) if not 0 <= x < page_size and x not in owners]
        if not bad:
            continue
        i, x = bad[0]
        dummy = "only slot 0 is" if page_size == 1 else f"slots [0, {page_size}) (page 0) are"
        v.fail("pad value", SLOT_BUFFER, {**w, "lane": lo + i, "page_size": page_size}, 0 if page_size == 1 else f"0..{page_size - 1}", x,
               f"a padded token row of a buffer the release's fill writes ({len(bad)} of {len(pad)} padded); at page size {page_size} "
               f"{dummy} dummy space (the KV allocator hands out slots from page 1 on), so slot {x} may be a live request's")
