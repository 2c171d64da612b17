"""The checks engine-check runs on the records an adapter produced: what the engine baked and what its replays left.

Each takes our records (harness.run.records) and the report's lines, never the engine: P1 on a replay
(`check_record`) and on each captured bucket (`check_captures`), the parities across runners and
branches (`check_parity`: I3, I6), and I6 on the logits the runners selected past the model call.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Callable, Optional

from harness.engines.after_model import next_token, selected_row, selected_tokens
from harness.engines.lanes import LiveBatch
from harness.engines.report import Line
from harness.engines.sglang.fields import sglang_field_policy
from harness.engines.sglang.handle import MULTI_LAYER, RunnerHandle
from harness.props.p1_records import P1, check_replay_record, check_replay_rows
from harness.run.layouts import branch_sibling
from harness.run.records import ReplayRecord
from harness.verdict import Verdict
from runners.parallel.layout import Branch, ParallelLayout

CAPTURE_FIELD = "capture field"  # I1 over every field, on an engine's runners: its own check, so a baseline names it


def check_captures(h: RunnerHandle, layout: ParallelLayout, tp_rank: int, line, expected_capture_bs: list[int], per_request: dict,
                    own: int, padding_mode: Optional[str] = "max_len") -> None:
    """Per bucket, what the capture baked: the engine's branch and buckets, the DP buffer the body set, I2 at capture;
    and each bucket's for_logprob per token for I3 / I6 (padding_mode None: the release picks the graph's DP padding)."""
    for bs in h.capture_bs:
        ln = line(h.kind, h.step, bs)
        ln.tokens_per_bs, ln.ranks = h.tokens_per_bs, ln.ranks | {tp_rank}
        w = {"layout": layout.describe(), "branch": layout.branch.value, "runner": h.kind, "step": h.step, "rank": tp_rank, "bs": bs}
        v = ln.verdict
        v.expect_equal("branch", "require_*_gather", w, layout.branch.value, h.engine_branch, "the engine's derived branch for this layout")
        v.expect_equal("padding", "capture_bs", w, expected_capture_bs, h.capture_bs,
                       "the capture buckets: multiples of the base that fit the pool (`harness explain padding`)")
        cap = h.captures[bs]
        host = cap.host
        rows_fed, logits_rows = h.capture_rows[bs]
        n = bs * h.tokens_per_bs
        ln.pruned = rows_fed == bs and n != bs
        if padding_mode is not None:
            v.expect_equal("padding", "dp_padding_mode", w, padding_mode, host["dp_padding_mode"], "draft-extend graphs pad every DP rank to the bucket")
        v.expect_equal("padding", "local_dp_buffer_len", w, n, host["local_dp_buffer_len"], "the step body's DP buffer holds bs * T tokens")
        if host["extend_num_tokens"] is not None:  # the single-layer runner leaves it unset
            v.expect_equal("padding", "extend_num_tokens", w, n, host["extend_num_tokens"])
        for name in ("global_num_tokens_cpu", "global_dp_buffer_len"):
            if host[f"fb_{name}"] is not None:
                v.expect_equal("capture", name, w, host[name], host[f"fb_{name}"], "forward batch vs the step body's set_dp_buffer_len")
            if not layout.require_gathered_buffer:
                v.expect_equal("padding", name, w, None, host[name], "no gathered buffer in this branch")
        if cap.global_num_tokens_for_logprob_gpu is not None:
            v.expect_equal("I2", "global_num_tokens_for_logprob_gpu (capture)", w, rows_fed, cap.global_num_tokens_for_logprob_gpu[own],
                           "rows fed to lm_head in the warm-up and capture runs")
        lp = cap.global_num_tokens_for_logprob_gpu
        per_request.setdefault((layout, tp_rank, h.kind, h.step), {})[bs] = (None if lp is None else Fraction(lp[own], n), Fraction(rows_fed, n), n)


def check_selected_parity(bodies: dict, live: LiveBatch, line, w: dict) -> None:
    """I6 on what was selected past the model call (after_model.py): the single-layer runner and the multi-layer
    runner's step 0 take each request's logits from its last accepted token, whichever of them prunes. At one
    width both read the same live batch. A disagreement is put on the runner that departs from the row rule
    applied to the live batch (the multi-layer one when both or neither do): never blind to a pruning runner."""
    for kind in MULTI_LAYER:
        _check_selected_pair(bodies.get(("single_layer", 0)), bodies.get((kind, 0)), live, line, w)


def _check_selected_pair(single, multi, live: LiveBatch, line, w: dict) -> None:
    if single is None or multi is None or single.tokens_per_bs != multi.tokens_per_bs:
        return
    W, ncd = single.tokens_per_bs, live.num_correct_drafts
    fed = live.tokens(W)["input_ids"]
    rule = [next_token(fed[selected_row(i, ncd[i], W, W, 0)]) for i in range(live.raw_bs)]
    s_tok, m_tok = selected_tokens(single, ncd), selected_tokens(multi, ncd)
    blamed = single if s_tok != rule and m_tok == rule else multi
    ref, got = (m_tok, s_tok) if blamed is single else (s_tok, m_tok)
    v = line(blamed.runner, blamed.step, blamed.bs).verdict
    v.checked += 1
    if ref != got:
        i = next(i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b)
        other = "multi-layer step 0" if blamed is single else "single-layer runner"
        v.fail("I6", "selected logits", {**w, "runner": blamed.runner, "step": blamed.step, "raw_bs": live.raw_bs, "bs": blamed.bs,
                                          "request": i}, ref[i], got[i],
               f"the token request {i}'s handed-back logits peak at: {other} (expected) vs this runner, both from its last accepted row")


def check_record(ln: Line, layout: ParallelLayout, rec: ReplayRecord, returned: Optional[int], tp_rank: int, it: int, needed: int,
                  tokens_aligned: bool = False) -> None:
    v = ln.verdict
    ln.raw_bs.add(rec.raw_bs)
    ln.ranks.add(tp_rank)
    n = rec.bs * rec.tokens_per_bs
    pruned = rec.rows_fed == rec.bs and n != rec.bs  # measured: the engine's logits processor feeds lm_head one row per request
    check_replay_record(v, layout, rec, tp_rank, it, needed, logprob_rows=rec.bs if pruned else None, require_host_lists=False,
                        tokens_aligned=tokens_aligned, field_policy=sglang_field_policy(rec.runner), field_check=CAPTURE_FIELD)
    check_replay_rows(v, layout, rec, tp_rank, it, expected_rows=rec.bs if pruned else n)
    w = {"layout": layout.describe(), "branch": rec.branch, "runner": rec.runner, "step": rec.step, "rank": tp_rank, "iteration": it,
         "raw_bs": rec.raw_bs, "bs": rec.bs}
    if returned is None:  # the one-graph composite's replay hands back its raw output (ONE_GRAPH_LOGITS)
        return
    v.expect_equal("padding", "returned logits rows", w, rec.raw_bs if pruned else rec.raw_bs * rec.tokens_per_bs, returned,
                   "rows handed back after replay: the real lanes only")


def check_parity(per_request: dict, layouts: tuple[ParallelLayout, ...], line: Callable[..., Line]) -> None:
    """I3 (MLP-TP vs attn-TP branch, same tp/dp) and I6 (single- vs multi-layer runner), per bucket.

    The comparable quantity is for_logprob per padded token, for_logprob / (bs * T): 1 for
    DRAFT_EXTEND_V2 (the widths T differ between the runners of some releases, so raw values
    would not compare). A difference that both runners explain by what they feed lm_head (I2
    holds on both: one prunes logits to a row per request, 1/T; docs/properties.md, I6) is the legal
    pruned variant: it is reported as a note with its evidence, not hidden. Anything else fails.
    `line(layout, rank, runner, step, bucket)` is the report line a result goes on.
    """
    for (layout, rank, kind, step), buckets in per_request.items():
        # I3
        sib = branch_sibling(layout)
        if sib is not None and sib in layouts and layout.branch is Branch.ATTN_TP_GATHER:
            theirs = per_request.get((sib, rank, kind, step), {})
            for bs, (lp, rows, n) in buckets.items():
                if bs not in theirs:
                    continue
                t_lp, t_rows, t_n = theirs[bs]
                w = {"layout": layout.describe(), "sibling": sib.describe(), "branch": layout.branch.value, "runner": kind, "step": step,
                     "rank": rank, "bs": bs}
                _compare(line(layout, rank, kind, step, bs).verdict, "I3", w, (t_lp, t_rows, t_n), (lp, rows, n),
                         "for_logprob per padded token, MLP-TP gather sibling (expected) vs attn-TP gather")
        # I6, both ways: a disagreement belongs to the runner whose for_logprob is not the rows it feeds lm_head
        if kind not in MULTI_LAYER:
            continue
        single = per_request.get((layout, rank, "single_layer", 0), {})
        for bs, (lp, rows, n) in buckets.items():
            if bs not in single:
                continue
            s_lp, s_rows, s_n = single[bs]
            w = {"layout": layout.describe(), "branch": layout.branch.value, "runner": kind, "step": step, "rank": rank, "bs": bs}
            multi_wrong, single_wrong = lp != rows, s_lp is not None and s_lp != s_rows
            if single_wrong and not multi_wrong:
                _compare(line(layout, rank, "single_layer", 0, bs).verdict, "I6", {**w, "runner": "single_layer", "step": 0, "vs_step": step},
                         (lp, rows, n), single[bs], "for_logprob per padded token, multi-layer (expected) vs single-layer runner")
            else:
                _compare(line(layout, rank, kind, step, bs).verdict, "I6", w, single[bs], (lp, rows, n),
                         "for_logprob per padded token, single-layer (expected) vs multi-layer runner")


def _compare(v: Verdict, check: str, w: dict, ref: tuple, got: tuple, what: str) -> None:
    (r_lp, r_rows, r_n), (g_lp, g_rows, g_n) = ref, got
    if r_lp is None and g_lp is None:
        return
    v.checked += 1
    if r_lp == g_lp:
        return
    explained = r_lp is not None and g_lp is not None and r_lp == r_rows and g_lp == g_rows
    if explained:
        v.notes.append(
            f"{P1}/{check} global_num_tokens_for_logprob: {_fmt(r_lp, r_n)} vs {_fmt(g_lp, g_n)}, each equal to the rows its runner feeds lm_head: "
            f"the pruned-logits variant (legal, `harness explain I2`; reported) [{', '.join(f'{k}={x}' for k, x in w.items())}]"
        )
    else:
        v.fail(check, "global_num_tokens_for_logprob", w, _fmt(r_lp, r_n), _fmt(g_lp, g_n), what)


def _fmt(x: Optional[Fraction], n: int) -> str:
    if x is None:
        return "absent"
    return f"{x * n} of {n} tokens" if x != 1 else f"all {n} tokens"
