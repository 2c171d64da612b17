"""Logprobs through the speculative loop (runners.logprobs): what P5 and P3 check on a case whose requests ask for them.

P5: a request that asked has one logprob per committed output token, equal to target-only greedy's at TP1 (the same
oracle as the tokens), and at each of them the oracle's top-k: ids exact except where the oracle itself has a near-tie,
values within LOGPROB_TOL. A request that did not ask has none. A logprob from the draft's logits, or from another row
of the verify (a row counted per request), is O(1) off.
P3: in a graph run every draft-extend batch replayed its graph (the draft passes run with return_logprob reset; a batch
that kept it can replay no graph captured with it off, and runs eagerly).
"""
from __future__ import annotations

from typing import Mapping

from harness.props.tolerances import CROSS_LAYOUT, Tol
from harness.verdict import Verdict
from runners.scheduler import Request
from runners.spec_decode import SpecEngine
from runners.target import GreedyOutput

# A logprob is a logit minus the row's logsumexp: the loop's verify rows and the oracle's decode rows are the same
# function of the same inputs, their sums reordered by the layout's shards and the batch shapes (the logits' P4 bound).
LOGPROB_TOL: dict[str, Tol] = {dtype: Tol(t.rtol, t.atol, f"logit - logsumexp of rows P4 bounds: {t.reason}") for dtype, t in CROSS_LAYOUT.items()}
# Two of the oracle's top-k logprobs closer than this may trade places between two correct computations (the P5
# tie margin on logits: a logprob gap is a logit gap).
TOP_TIE = 1e-4


def _close(a: float, b: float, tol: Tol) -> bool:
    return abs(a - b) <= tol.atol + tol.rtol * abs(b)


def _tied(vals: list[float], j: int) -> bool:
    """Position j of the oracle's top list (one entry longer than compared) has a neighbour within TOP_TIE."""
    return any(0 <= n < len(vals) and abs(vals[n] - vals[j]) < TOP_TIE for n in (j - 1, j + 1))


def check_request_logprobs(v: Verdict, r: Request, ref: GreedyOutput, tol: Tol, where: dict) -> None:
    """One request's logprobs against the oracle's, up to the first output token the two disagree on (P5 reports that)."""
    got = r.tokens[len(r.prompt):]
    v.checked += 1
    if not r.return_logprob:
        if r.output_token_logprobs or r.output_top_logprobs_idx:
            v.fail("logprobs", "output_token_logprobs", where, "none (the request did not ask)", len(r.output_token_logprobs))
        return
    if len(r.output_token_logprobs) != len(got):
        v.fail("logprobs", "output_token_logprobs", where, f"one per committed token ({len(got)})", len(r.output_token_logprobs))
        return
    want_top = len(got) if r.top_logprobs_num else 0
    if len(r.output_top_logprobs_idx) != want_top or len(r.output_top_logprobs_val) != want_top:
        v.fail("logprobs", "output_top_logprobs", where, f"{want_top} lists (top_logprobs_num {r.top_logprobs_num})", len(r.output_top_logprobs_idx))
        return
    same = next((i for i, (a, b) in enumerate(zip(got, ref.tokens, strict=False)) if a != b), min(len(got), len(ref.tokens)))
    for p in range(same):
        w = {**where, "position": p}
        v.checked += 1
        if not _close(r.output_token_logprobs[p], ref.logprobs[p], tol):
            v.fail("logprobs", "token logprob", w, round(ref.logprobs[p], 6), round(r.output_token_logprobs[p], 6),
                   f"rtol={tol.rtol} atol={tol.atol}: {tol.reason}")
            return
        if not r.top_logprobs_num:
            continue
        k = r.top_logprobs_num
        ids, vals = r.output_top_logprobs_idx[p], r.output_top_logprobs_val[p]
        o_ids, o_vals = ref.top_logprobs_idx[p], ref.top_logprobs_val[p]
        bad = next((j for j in range(k) if ids[j] != o_ids[j] and not _tied(o_vals, j)), None)
        if bad is None:
            bad = next((j for j in range(k) if not _close(vals[j], o_vals[j], tol)), None)
        if bad is not None:
            v.fail("logprobs", "top logprobs", {**w, "rank": bad}, list(zip(o_ids[:k], [round(x, 5) for x in o_vals[:k]], strict=True)),
                   list(zip(ids, [round(x, 5) for x in vals], strict=True)), "the target's top-k at this output position")
            return


def check_logprobs(v: Verdict, reqs: Mapping[int, Request], ref: Mapping[int, GreedyOutput], dtype: str, where: dict) -> None:
    """Every request of a session into v, P5's verdict (ref: the oracle with top_logprobs_num + 1, harness.run.loop.oracle)."""
    tol = LOGPROB_TOL[dtype]
    for rid, r in sorted(reqs.items()):
        check_request_logprobs(v, r, ref[rid], tol, {**where, "request": rid})


def check_draft_passes_replayed(v: Verdict, engines: list[SpecEngine], max_batch: int, where: dict) -> None:
    """Into v, P3's verdict: no draft-extend batch of a graph run fell back to eager, when every batch fits the buckets
    (max_batch: the most requests a DP group runs). Nothing is checked when the buckets cannot hold every batch (a
    fallback is then legitimate)."""
    drivers = [e.draft.driver for e in engines if getattr(e.draft, "driver", None) is not None]
    if not drivers or any(max(r.capture_bs) < max_batch for d in drivers for r in d.runners):
        return
    v.expect_equal("replayed", "draft-extend eager fallbacks", where, 0, sum(d.stats.eager_fallbacks for d in drivers),
                   "a draft batch that carries return_logprob can replay no graph (the draft passes run with it reset)")
