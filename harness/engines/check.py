"""Our invariants on an engine's own runners: drive the adapter's capture and replay, check the records.

Builds SGLang's multi-layer EAGLE draft-extend graph runner (one per speculative step) and
the single-layer one for a representative layout of every branch of DESIGN.md §6 (MLP-TP
gather, attn-TP gather, neither), without a model or a GPU; runs the engine's capture path
for every bucket (get_forward_batch(bs) and the step body up to the model) and its replay /
prepare path for every raw batch size up to each bucket; converts what the engine produced
into our records (harness.run.records.CaptureRecord / ReplayRecord) and runs the same P1
checks our runners pass: I1 capture = replay, I2 rows fed to lm_head = for_logprob, I3
branch parity, I4 buffer = Σ for_logprob, I5 for_logprob vs num_tokens, I6 single- vs
multi-layer, and the padding rules. The graphed draft decode (sglang/draft_decode.py) gets
the same P1 record checks and padded-lane checks, on its own lines (runner draft_decode).
"""
from __future__ import annotations

import functools
import time
from fractions import Fraction
from typing import Optional

from harness.engines.after_model import check_body, next_token, selected_row, selected_tokens
from harness.engines.install import version_key
from harness.engines.lanes import FILLED_SINCE, LiveBatch, check_lanes, live_batch
from harness.engines.report import EngineReport, Line
from harness.engines.sglang import draft_decode, eager_check, logits_gather, one_graph, target_verify
from harness.engines.sglang.build import EngineRunners
from harness.engines.sglang.config import EngineConfig
from harness.engines.sglang.handle import MULTI_LAYER, ONE_GRAPH, RunnerHandle
from harness.engines.sglang.loader import Engine
from harness.props.p1_records import P1, check_replay_record, check_replay_rows, verify_capture_bs
from harness.run.layouts import branch_sibling
from harness.run.records import ReplayRecord
from harness.verdict import Verdict
from runners.cuda_graph import compute_capture_bs
from runners.parallel.layout import Branch, ParallelLayout

# One or two representative layouts per branch (DESIGN.md §6.1, "which layouts reach which branch").
REPRESENTATIVE_LAYOUTS: tuple[ParallelLayout, ...] = (
    ParallelLayout(4, 2, True),  # MLP-TP gather: DP attention with default flags
    ParallelLayout(4, 1, False, 1),  # attn-TP gather (i): no DP attention, moe_dense_tp_size = 1
    ParallelLayout(4, 2, True, 1, True, "deepep"),  # attn-TP gather (ii): DP attention, dp < tp, dense 1, dp lm_head, a2a
    ParallelLayout(4),  # neither: plain TP
    ParallelLayout(4, 4, True, 1, True, "deepep"),  # neither: DP attention with dp = tp and the flags of (ii)
)
# Where prepare()'s Triton fill kernel runs (interpreted: slow) on the first rank: one layout with
# gathered buffers and one without, which between them reach every role of the kernel. Every other
# replay of a release that has the native twin fills through the twin (the NPU path).
KERNEL_LAYOUTS: tuple[ParallelLayout, ...] = (ParallelLayout(4, 1, False, 1), ParallelLayout(4))



# What engine-check cannot reach on an engine, said in every report (never counted as a pass).
SKIPPED: tuple[str, ...] = ()
# I7 where check_engine is not asked for it (eager=False): said, never passed.
ONE_GRAPH_LOGITS = (f"{ONE_GRAPH}: the logits replay(step) hands back: not checked: the one-graph composite serves each step's raw "
                    "output, whose logits buffer every step shares (the last step's write wins), and its worker reads only the top-k "
                    "(checked: `served`); each step's logits are checked where the model stand-in produced them (`select`)")
ONE_GRAPH_NATIVE = (f"{ONE_GRAPH}: prepare()'s native (NPU) fill twin: not run on this runner: the worker builds the one graph only "
                    "off NPU (`if not _is_npu` in _capture_cuda_graphs), so its prepare() fills with the Triton kernel on every "
                    "replay here; the twin is checked on the per-step composite")
ONE_GRAPH_OFF = (f"{ONE_GRAPH}: not built: {one_graph.FLAG} is off in this process, so the worker builds the per-step composite for every "
                 "attention backend")
I7_OFF = ("I7 (eager vs graph): not run (`harness engine-check --eager`, or check_engine(eager=True), runs it: the scheduler's MLP sync and the worker's eager "
          "draft-extend batch, harness/engines/sglang/eager.py; docs/engine-check.md, I7, says what it finds)")


# ----------------------------------------------------------------------------------------
# the schedule of live batches
# ----------------------------------------------------------------------------------------


def _schedule(layout: ParallelLayout, capture_bs: list[int]) -> list[list[int]]:
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


# ----------------------------------------------------------------------------------------
# the check
# ----------------------------------------------------------------------------------------


def check_engine(engine: Engine, layouts: tuple[ParallelLayout, ...] = REPRESENTATIVE_LAYOUTS, cfg: Optional[EngineConfig] = None, progress=None,
                 kernel_layouts: tuple[ParallelLayout, ...] = KERNEL_LAYOUTS, eager: bool = False) -> EngineReport:
    cfg = cfg or EngineConfig()
    t0 = time.perf_counter()
    lines: dict[tuple, Line] = {}
    # (layout, rank, runner, step) -> {bucket: (for_logprob per token at capture, rows fed to lm_head per token, bs * T)}, for I3 / I6
    per_request: dict[tuple, dict[int, tuple[Optional[Fraction], Fraction, int]]] = {}

    # the buffers whose padded lanes this release's fill writes, per runner (lanes.FILLED_SINCE)
    filled = {kind: frozenset(b for (k, b), since in FILLED_SINCE.items() if k == kind and version_key(since) <= version_key(engine.version))
              for kind in ("multi_layer", "single_layer", draft_decode.KIND, target_verify.KIND)}
    filled[ONE_GRAPH] = filled["multi_layer"]  # the same prepare() fills both composites' buffers

    def line(layout: ParallelLayout, runner: str, step: int, bucket: int) -> Line:
        key = (layout, runner, step, bucket)
        if key not in lines:
            lines[key] = Line(runner, step, layout, bucket)
        return lines[key]

    dd_mod, dd_why = draft_decode.load(engine)
    skipped = list(SKIPPED) + ([] if eager else [I7_OFF]) + ([] if dd_mod is not None else [f"draft_decode (EAGLEDraftCudaGraphRunner): n/a: {dd_why}"])
    gather_na: list[str] = []
    no_gather: list[str] = []  # layouts whose logits processor does not gather across DP groups
    tv_mod, tv_model_runner, tv_why = target_verify.load(engine)
    skipped += [] if tv_mod is not None else [f"target_verify (the target's TARGET_VERIFY graphs): n/a: {tv_why}"]

    for layout in layouts:
        if progress:
            progress(f"{layout.describe()}")
        expected_capture_bs = compute_capture_bs(layout, cfg.capture_bs, cfg.max_running_requests)
        gather, first = None, None
        for d in range(layout.attn_dp_size):
            tp_rank = d * layout.attn_tp_size
            own = d if layout.require_mlp_tp_gather else 0
            if engine.fill is not None:
                engine.fill.kernel = d == 0 and layout in kernel_layouts
            runners = EngineRunners(engine, layout, tp_rank, cfg)
            first = first or runners
            if d == 0:
                gather, why = logits_gather.setup(engine, layout, runners.server_args, cfg.vocab_size, cfg.hidden_size,
                                                  line(layout, "multi_layer", 0, runners.multi[0].capture_bs[0]).verdict,
                                                  {"layout": layout.describe(), "branch": layout.branch.value})
                gather_na += [why] if why else []
                no_gather += [layout.describe()] if gather is None and not why else []
            for h in runners.handles:
                h.on_launch = None if gather is None else gather.take
            seen_lanes: dict = {}
            driven: set[int] = set()
            # replay first: a line's first failure is then the one our own P1 reports for the same bug (I1)
            sched = _schedule(layout, runners.multi[0].capture_bs)
            for it, dp_sizes in enumerate(sched):
                raw = dp_sizes[d]
                needed = max(dp_sizes) if layout.require_mlp_tp_gather else raw
                live = live_batch(raw, dp_sizes, it, cfg.num_draft_tokens, cfg.max_running_requests)
                # past the model call (after_model.py), where the interpreted kernels run, once per full bucket (every row
                # real, the last request's too) and once at raw_bs 1 (the most padding): the body's checks are on the real
                # rows, which no history may change (the padded lanes' history is lanes.py's)
                drive = d == 0 and layout in kernel_layouts and raw not in driven and (raw == 1 or raw in runners.multi[0].capture_bs)
                driven |= {raw} if drive else set()
                for h in runners.handles:
                    h.drive_body = drive
                if gather is not None:
                    gather.where = (it, d, tuple(dp_sizes))
                results = runners.replay_multi_layer(live) + [runners.replay_single_layer(live)]
                bodies = {}
                for rec, returned, lane_recs, body in results:
                    ln = line(layout, rec.runner, rec.step, rec.bs)
                    _check_record(ln, layout, rec, returned, tp_rank, it, needed)
                    w = {"layout": layout.describe(), "branch": layout.branch.value, "runner": rec.runner, "step": rec.step, "rank": tp_rank,
                         "iteration": it, "raw_bs": rec.raw_bs, "bs": rec.bs}
                    for lr in lane_recs:
                        check_lanes(ln.verdict, lr, live, seen_lanes, w, filled[lr.runner])
                    if body is not None:
                        prev = bodies.get((rec.runner, rec.step - 1))
                        check_body(ln.verdict, body, live.num_correct_drafts, prev, w)
                        bodies[(rec.runner, rec.step)] = body
                w_it = {"layout": layout.describe(), "branch": layout.branch.value, "rank": tp_rank, "iteration": it}
                _check_selected_parity(bodies, live, functools.partial(line, layout), w_it)
                og = runners.one_graph
                for step, served in enumerate(og.served if og else []):
                    h = og.handles[step]
                    one_graph.check_served(line(layout, ONE_GRAPH, step, h.snapshots[-1].bs).verdict, step, served,
                                           bodies.get((ONE_GRAPH, step)), live.num_correct_drafts,
                                           {**w_it, "runner": ONE_GRAPH, "step": step, "raw_bs": raw, "bs": h.snapshots[-1].bs})
            if runners.one_graph is not None:
                one_graph.check_restore(functools.partial(line, layout), runners.one_graph,
                                        {"layout": layout.describe(), "branch": layout.branch.value, "runner": ONE_GRAPH, "step": 0, "rank": tp_rank})
            if dd_mod is not None:
                _check_draft_decode(draft_decode.DraftDecodeHandle(dd_mod, runners), layout, d, tp_rank, functools.partial(line, layout),
                                    filled["draft_decode"])
            for h in runners.handles:
                _check_captures(h, layout, tp_rank, functools.partial(line, layout), expected_capture_bs, per_request, own)
            if tv_mod is not None:
                _check_target_verify(target_verify.TargetVerify(tv_mod, tv_model_runner, runners), layout, d, tp_rank,
                                     functools.partial(line, layout), filled[target_verify.KIND], per_request)
        if eager:  # I7: the engine's eager batch for the same loads, against what the graphs baked (eager_check.py)
            why = eager_check.check_eager(first, layout, _schedule(layout, first.multi[0].capture_bs), per_request, functools.partial(line, layout),
                                            gather)
            skipped += [why] if why and why not in skipped else []
        if gather is not None:
            why = gather.check(functools.partial(line, layout), {"layout": layout.describe(), "branch": layout.branch.value})
            gather_na += [why] if why else []
    skipped += sorted(set(gather_na))
    if one_graph.available(engine):
        skipped.append(ONE_GRAPH_LOGITS if one_graph.flag_on(engine) else ONE_GRAPH_OFF)
        if one_graph.flag_on(engine) and engine.fill is not None and engine.fill.native is not None:
            skipped.append(ONE_GRAPH_NATIVE)
    if no_gather:
        skipped.append(f"{logits_gather.CHECK} on {', '.join(no_gather)}: nothing to run: the engine's LogitsProcessor does not gather "
                       "logits rows across DP groups there (do_tensor_parallel_all_gather_dp_attn false: no DP attention, or dp lm_head), "
                       "so for_logprob reaches no DP gather (the attn-TP gather layouts, the seed bug's, are among them)")
    _check_parity(lines, per_request, layouts, line)
    ordered = sorted(lines.values(), key=lambda ln: (layouts.index(ln.layout), ln.runner != "multi_layer", ln.step, ln.bucket))
    return EngineReport("sglang", engine.version, engine.generation, engine.location, ordered, engine.stubbed, time.perf_counter() - t0,
                        skipped)


def _check_captures(h: RunnerHandle, layout: ParallelLayout, tp_rank: int, line, expected_capture_bs: list[int], per_request: dict,
                    own: int, padding_mode: Optional[str] = "max_len") -> None:
    """Per bucket, what the capture baked: the engine's branch and buckets, the DP buffer the body set, I2 at capture;
    and each bucket's for_logprob per token for I3 / I6 (padding_mode None: the release picks the graph's DP padding)."""
    for bs in h.capture_bs:
        ln = line(h.kind, h.step, bs)
        ln.tokens_per_bs, ln.ranks = h.tokens_per_bs, ln.ranks | {tp_rank}
        w = {"layout": layout.describe(), "branch": layout.branch.value, "runner": h.kind, "step": h.step, "rank": tp_rank, "bs": bs}
        v = ln.verdict
        v.expect_equal("branch", "require_*_gather", w, layout.branch.value, h.engine_branch, "the engine's derived branch for this layout")
        v.expect_equal("padding", "capture_bs", w, expected_capture_bs, h.capture_bs, "DESIGN.md §6.2: multiples of the base that fit the pool")
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


def _check_target_verify(tv: target_verify.TargetVerify, layout: ParallelLayout, d: int, tp_rank: int, line, filled: frozenset[str],
                         per_request: dict) -> None:
    """The target verify graphs: P1 on every capture and replay as for the draft-extend runners (TARGET_VERIFY computes
    logits for every token, so for_logprob = num_tokens = rows fed to lm_head = bs * T), its spec_info as baked, and
    the padded lanes of the buffers its replay fill resets."""
    T, cfg, seen, own = tv.tokens_per_bs, tv.cfg, {}, d if layout.require_mlp_tp_gather else 0
    # replay first, as for the draft-extend runners: a line's first failure is then the one our own P1 reports first
    for it, dp_sizes in enumerate(_schedule(layout, tv.capture_bs)):
        raw = dp_sizes[d]
        live = live_batch(raw, dp_sizes, it, T, cfg.max_running_requests)
        rec, returned, lanes = tv.replay(live)
        ln = line(target_verify.KIND, 0, rec.bs)
        _check_record(ln, layout, rec, returned, tp_rank, it, max(dp_sizes) if layout.require_mlp_tp_gather else raw, tokens_aligned=True)
        w = {"layout": layout.describe(), "branch": layout.branch.value, "runner": target_verify.KIND, "step": 0, "rank": tp_rank,
             "iteration": it, "raw_bs": raw, "bs": rec.bs}
        for lr in lanes:
            check_lanes(ln.verdict, lr, live, seen, w, filled)
    _check_captures(tv.handle, layout, tp_rank, line, verify_capture_bs(layout, cfg.capture_bs, cfg.max_running_requests, T), per_request,
                    own, padding_mode=None)
    for bs, spec in tv.spec.items():
        v = line(target_verify.KIND, 0, bs).verdict
        w = {"layout": layout.describe(), "branch": layout.branch.value, "runner": target_verify.KIND, "step": 0, "rank": tp_rank, "bs": bs}
        v.expect_equal("capture", "spec_info.draft_token_num", w, T, spec.draft_token_num, "the verify tree's tokens per request")
        if spec.hidden_rows is not None:
            v.expect_equal("capture", "spec_info.hidden_states rows", w, bs * T, spec.hidden_rows, "one per token (MTP models read them)")
        if spec.custom_mask_len is not None:
            v.expect_equal("capture", "custom_mask covers the batch", w, True, spec.custom_mask_len >= T * (spec.seq_lens_sum + bs * T),
                           f"T rows of seq_len + T per request: {T * (spec.seq_lens_sum + bs * T)} needed, {spec.custom_mask_len} held")


def _check_draft_decode(dd: draft_decode.DraftDecodeHandle, layout: ParallelLayout, d: int, tp_rank: int, line, filled: frozenset[str]) -> None:
    """P1 and the padded lanes of the engine's graphed draft decode: DECODE counts bs * topk tokens, a logits row each
    (as runners.eagle_draft_graph, harness.props.p1_metadata's draft-decode check), so for_logprob == num_tokens."""
    k, cfg, seen = dd.tokens_per_bs, dd.cfg, {}
    for it, dp_sizes in enumerate(_schedule(layout, dd.capture_bs)):
        raw = dp_sizes[d]
        needed = max(dp_sizes) if layout.require_mlp_tp_gather else raw
        live = live_batch(raw, dp_sizes, it, cfg.num_draft_tokens, cfg.max_running_requests)
        rec, lanes = dd.replay(live)
        ln = line(draft_decode.KIND, 0, rec.bs)
        ln.raw_bs.add(raw)
        ln.ranks.add(tp_rank)
        ln.tokens_per_bs = k
        check_replay_record(ln.verdict, layout, rec, tp_rank, it, needed, require_host_lists=False)
        w = {"layout": layout.describe(), "branch": layout.branch.value, "runner": draft_decode.KIND, "step": 0, "rank": tp_rank,
             "iteration": it, "raw_bs": raw, "bs": rec.bs}
        check_lanes(ln.verdict, lanes, live, seen, w, filled)


def _check_selected_parity(bodies: dict, live: LiveBatch, line, w: dict) -> None:
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


def _check_record(ln: Line, layout: ParallelLayout, rec: ReplayRecord, returned: Optional[int], tp_rank: int, it: int, needed: int,
                  tokens_aligned: bool = False) -> None:
    v = ln.verdict
    ln.raw_bs.add(rec.raw_bs)
    ln.ranks.add(tp_rank)
    n = rec.bs * rec.tokens_per_bs
    pruned = rec.rows_fed == rec.bs and n != rec.bs  # measured: the engine's logits processor feeds lm_head one row per request
    check_replay_record(v, layout, rec, tp_rank, it, needed, logprob_rows=rec.bs if pruned else None, require_host_lists=False,
                        tokens_aligned=tokens_aligned)
    check_replay_rows(v, layout, rec, tp_rank, it, expected_rows=rec.bs if pruned else n)
    w = {"layout": layout.describe(), "branch": rec.branch, "runner": rec.runner, "step": rec.step, "rank": tp_rank, "iteration": it,
         "raw_bs": rec.raw_bs, "bs": rec.bs}
    if returned is None:  # the one-graph composite's replay hands back its raw output (ONE_GRAPH_LOGITS)
        return
    v.expect_equal("padding", "returned logits rows", w, rec.raw_bs if pruned else rec.raw_bs * rec.tokens_per_bs, returned,
                   "rows handed back after replay: the real lanes only")


def _check_parity(lines: dict, per_request: dict, layouts: tuple[ParallelLayout, ...], line) -> None:
    """I3 (MLP-TP vs attn-TP branch, same tp/dp) and I6 (single- vs multi-layer runner), per bucket.

    The comparable quantity is for_logprob per padded token, for_logprob / (bs * T): 1 for
    DRAFT_EXTEND_V2 (the widths T differ between the runners of some releases, so raw values
    would not compare). A difference that both runners explain by what they feed lm_head (I2
    holds on both: one prunes logits to a row per request, 1/T, DESIGN.md §6.3) is the legal
    pruned variant: it is reported as a note with its evidence, not hidden. Anything else fails.
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
                _compare(line(layout, kind, step, bs).verdict, "I3", w, (t_lp, t_rows, t_n), (lp, rows, n),
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
                _compare(line(layout, "single_layer", 0, bs).verdict, "I6", {**w, "runner": "single_layer", "step": 0, "vs_step": step},
                         (lp, rows, n), single[bs], "for_logprob per padded token, multi-layer (expected) vs single-layer runner")
            else:
                _compare(line(layout, kind, step, bs).verdict, "I6", w, single[bs], (lp, rows, n),
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
            f"the pruned-logits variant of DESIGN.md §6.3 (legal; reported) [{', '.join(f'{k}={x}' for k, x in w.items())}]"
        )
    else:
        v.fail(check, "global_num_tokens_for_logprob", w, _fmt(r_lp, r_n), _fmt(g_lp, g_n), what)


def _fmt(x: Optional[Fraction], n: int) -> str:
    if x is None:
        return "absent"
    return f"{x * n} of {n} tokens" if x != 1 else f"all {n} tokens"
