"""The properties, as plain functions returning a Verdict (DESIGN.md §4, §6.6).

P1 metadata invariants: a fast path that drives the graph runners' get_forward_batch and
prepare_replay without a model (hundreds of examples per second), and a run path that
checks what actually reached lm_head. P3 eager vs graph. P4 cross-layout against TP1.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from harness.execute import RankRun
from harness.layout import branch_sibling
from harness.scenario import Scenario
from harness.tolerances import Tol, cross_layout, eager_vs_graph
from harness.verdict import Verdict
from runners.config import DEFAULT_MODEL, ModelConfig, SpecConfig
from runners.cuda_graph import (
    EagleDraftExtendCudaGraphRunner,
    EagleDraftExtendCudaGraphRunnerBase,
    MultiLayerEagleDraftExtendCudaGraphRunner,
    ReplayRecord,
)
from runners.draft_extend import SEQ_LEN_FILL_VALUE, DraftExtendInputs, DraftWorker
from runners.graph_backend import GraphBackend
from runners.parallel.dp_attention import RankContext
from runners.parallel.layout import ParallelLayout
from runners.verify_graph import TargetVerifyCudaGraphRunner, VerifyInputs

# ----------------------------------------------------------------------------------------
# P1, fast path: metadata only
# ----------------------------------------------------------------------------------------


def _metadata_runners(layout: ParallelLayout, spec: SpecConfig, model: ModelConfig, tp_rank: int) -> list[EagleDraftExtendCudaGraphRunnerBase]:
    ctx = RankContext(layout, tp_rank, comm=None)  # no collectives on this path
    backend = GraphBackend("sim")
    multi = DraftWorker(ctx, model, spec, build_model=False)
    single = DraftWorker(ctx, model, spec, num_layers=1, build_model=False)
    runners: list[EagleDraftExtendCudaGraphRunnerBase] = [
        MultiLayerEagleDraftExtendCudaGraphRunner(multi, k, backend) for k in range(spec.num_steps)
    ]
    runners.append(EagleDraftExtendCudaGraphRunner(single, backend))
    return runners


def _synthetic_inputs(raw_bs: int, T: int, hidden: int, dp_batch_sizes: list[int], seed: int) -> DraftExtendInputs:
    g = torch.Generator().manual_seed(seed)
    n = raw_bs * T
    return DraftExtendInputs(
        input_ids=torch.zeros(n, dtype=torch.int64),
        positions=torch.zeros(n, dtype=torch.int64),
        seq_lens=torch.randint(T, 4 * T, (raw_bs,), generator=g),
        req_pool_indices=torch.arange(1, raw_bs + 1),
        hidden_states=torch.zeros(n, hidden),
        accept_lens=torch.randint(1, T + 1, (raw_bs,), generator=g),
        dp_batch_sizes=list(dp_batch_sizes),
    )


def _where(layout: ParallelLayout, rec: ReplayRecord, tp_rank: int, iteration: int) -> dict:
    return {
        "layout": layout.describe(),
        "branch": rec.branch,
        "runner": rec.runner,
        "step": rec.step,
        "rank": tp_rank,
        "iteration": iteration,
        "raw_bs": rec.raw_bs,
        "bs": rec.bs,
    }


def check_replay_record(
    v: Verdict,
    layout: ParallelLayout,
    rec: ReplayRecord,
    tp_rank: int,
    iteration: int,
    needed_bs: int,
    *,
    logprob_rows: Optional[int] = None,
    require_host_lists: bool = True,
) -> None:
    """I1, I4, I5 and the padding rules on one replay's record.

    The two keyword parameters describe legal engine variants (DESIGN.md §6.3, §6.5); their
    defaults are our runners' behaviour, and `harness engine-check` passes them for SGLang:

    logprob_rows: the logit rows per rank lm_head sees in this bucket. None (ours): every
        DRAFT_EXTEND_V2 token, bs * T, so for_logprob == num_tokens (I5) and the gathered
        buffer is Σ for_logprob (I4). A pruned-logits engine feeds lm_head one row per request
        and passes bs: then for_logprob (baked and filled) must be bs per rank, and
        global_dp_buffer_len keeps sizing the token buffer (Σ num_tokens), while the logits
        gather sizes itself from Σ for_logprob. The invariant is "for_logprob equals the rows
        given to lm_head", not a fixed formula; the caller states the rows it measured.
    require_host_lists: our runners bake both host lists, global_num_tokens_cpu and
        global_num_tokens_for_logprob_cpu, into the forward batch. An engine that gives only
        the gpu tensors for one of them (the logits processor then sizes its gather from
        global_dp_buffer_len and reads counts from the gpu tensor, §6.5) passes False: an
        absent host list is not compared in I1, and I4 / I5 use the capture-time gpu value
        in its place, which is what the graph holds. A host list that is given is checked.
    """
    w = _where(layout, rec, tp_rank, iteration)
    T, bs = rec.tokens_per_bs, rec.bs
    n = bs * T
    lp_rows = n if logprob_rows is None else logprob_rows
    # padding rules
    v.expect_equal("padding", "bs in capture_bs", w, True, bs in rec.captured_bs)
    v.expect_equal("padding", "bs >= raw_bs", w, True, bs >= needed_bs, f"needed {needed_bs}")
    smaller = [b for b in rec.captured_bs if needed_bs <= b < bs]
    v.expect_equal("padding", "smallest bucket", w, [], smaller, "a smaller captured bucket fits")
    if layout.require_gathered_buffer:
        v.expect_equal("padding", "bs % attn_tp_size", w, 0, bs % layout.attn_tp_size)
    v.expect_equal("padding", "padded seq_lens", w, [SEQ_LEN_FILL_VALUE] * (bs - rec.raw_bs), rec.padded_seq_lens)
    v.expect_equal("padding", "seq_lens_sum", w, rec.seq_lens_sum_actual, rec.seq_lens_sum, "metadata sum vs the buffer's lanes")
    host = rec.capture.host
    v.expect_equal("padding", "capture num_tokens", w, n, host["num_tokens"])
    if not layout.require_gathered_buffer:
        v.expect_equal("padding", "global_num_tokens_gpu", w, None, rec.global_num_tokens_gpu, "no gathered buffer in this branch")
        return
    dp = layout.attn_dp_size if layout.require_mlp_tp_gather else 1
    v.expect_equal("padding", "gathered gpu shape", w, (dp,), rec.gpu_shape)
    # replay fill = bs * T in both gpu tensors
    v.expect_equal("fill", "global_num_tokens_gpu (replay fill)", w, [n] * dp, rec.global_num_tokens_gpu)
    v.expect_equal("fill", "global_num_tokens_for_logprob_gpu (replay fill)", w, [lp_rows] * dp, rec.global_num_tokens_for_logprob_gpu)
    # I1: capture = replay, for every gathered tensor and its host list
    cap = rec.capture
    v.expect_equal("I1", "global_num_tokens_gpu", w, rec.global_num_tokens_gpu, cap.global_num_tokens_gpu, "baked at capture vs replay fill")
    v.expect_equal(
        "I1", "global_num_tokens_for_logprob_gpu", w, rec.global_num_tokens_for_logprob_gpu, cap.global_num_tokens_for_logprob_gpu,
        "baked at capture vs replay fill",
    )
    host_nt, host_lp = host["global_num_tokens_cpu"], host["global_num_tokens_for_logprob_cpu"]
    if host_nt is not None or require_host_lists:
        v.expect_equal("I1", "global_num_tokens_cpu", w, rec.global_num_tokens_gpu, host_nt)
    else:
        host_nt = cap.global_num_tokens_gpu  # no host list: the graph holds the gpu value
    if host_lp is not None or require_host_lists:
        v.expect_equal("I1", "global_num_tokens_for_logprob_cpu", w, rec.global_num_tokens_for_logprob_gpu, host_lp)
    else:
        host_lp = cap.global_num_tokens_for_logprob_gpu
    lp, nt = host_lp or [], host_nt or []
    if logprob_rows is None:
        # I5: DRAFT_EXTEND_V2 is unpruned: for_logprob == num_tokens == bs * T, per rank
        v.expect_equal("I5", "global_num_tokens_for_logprob", w, list(nt), list(lp), "DRAFT_EXTEND_V2 emits logits for every token")
    else:
        v.expect_equal("I5", "global_num_tokens_for_logprob", w, [lp_rows] * dp, list(lp), f"pruned logits: lm_head sees {lp_rows} rows per rank")
        v.expect_equal("I5", "for_logprob <= num_tokens", w, True, len(lp) == len(nt) and all(a <= b for a, b in zip(lp, nt, strict=True)))
    v.expect_equal("I5", "global_num_tokens", w, [n] * dp, list(nt), "tokens, not requests: bs * num_tokens_per_bs")
    # I4 and the padding mode: buffer = Σ for_logprob = max * dp (MAX_LEN); pruned: the token buffer, Σ num_tokens
    if logprob_rows is None:
        v.expect_equal("I4", "global_dp_buffer_len", w, sum(lp), host["global_dp_buffer_len"], "Σ for_logprob = gathered rows")
    else:
        v.expect_equal("I4", "global_dp_buffer_len", w, sum(nt), host["global_dp_buffer_len"], "pruned logits: the DP buffer holds every token")
    if host["dp_padding_mode"] == "max_len" and nt:
        v.expect_equal("padding", "global_dp_buffer_len (MAX_LEN)", w, max(nt) * len(nt), host["global_dp_buffer_len"])


def check_metadata(
    layout: ParallelLayout,
    spec: SpecConfig,
    schedule: Sequence[Sequence[int]],
    model: ModelConfig = DEFAULT_MODEL,
    seed: int = 0,
) -> Verdict:
    """P1 over one layout and a schedule (per iteration: each DP group's raw batch size).

    Drives every graph runner (each multi-layer step and the single-layer one) of one rank
    per DP group through capture-time get_forward_batch and replay-time prepare_replay.
    """
    v = Verdict("P1")
    T = spec.num_tokens_per_bs
    for d in range(layout.attn_dp_size):
        tp_rank = d * layout.attn_tp_size
        runners = _metadata_runners(layout, spec, model, tp_rank)
        lp_by_runner: dict[tuple[str, int], list[Optional[int]]] = {}
        for it, sizes in enumerate(schedule):
            dp_sizes = list(sizes) if layout.attn_dp_size > 1 else [sizes[0]]
            raw_bs = dp_sizes[d]
            inp = _synthetic_inputs(raw_bs, T, model.hidden_size, dp_sizes, seed + 1000 * it + d)
            for r in runners:
                if not r.can_run(inp):
                    continue
                r.reset_for_iteration(raw_bs, inp.accept_lens)
                rec = r.prepare_replay(inp)
                needed = max(dp_sizes) if layout.require_mlp_tp_gather else raw_bs
                check_replay_record(v, layout, rec, tp_rank, it, needed)
                host_lp = rec.capture.host["global_num_tokens_for_logprob_cpu"]
                own = None if host_lp is None else host_lp[d if layout.require_mlp_tp_gather else 0]
                lp_by_runner.setdefault((r.runner_kind, r.step), []).append(own)
        _check_verify_metadata(v, layout, spec, schedule, model, tp_rank, seed)
        # I6: single-layer and multi-layer agree on for_logprob (each multi-layer step vs single)
        single = lp_by_runner.get(("single_layer", 0), [])
        for (kind, step), vals in lp_by_runner.items():
            if kind == "multi_layer":
                v.expect_equal("I6", "global_num_tokens_for_logprob", {"layout": layout.describe(), "rank": tp_rank, "step": step}, single, vals,
                               "single-layer vs multi-layer runner, same batches")
    _check_branch_parity(v, layout, spec, schedule, model, seed)
    return v


def _check_verify_metadata(v: Verdict, layout: ParallelLayout, spec: SpecConfig, schedule, model: ModelConfig, tp_rank: int, seed: int) -> None:
    """I1, I4, I5 and the padding rules for the TARGET_VERIFY runner of one rank: logits for every token, like DRAFT_EXTEND_V2."""
    d = layout.attn_dp_rank(tp_rank)
    runner = TargetVerifyCudaGraphRunner(RankContext(layout, tp_rank, comm=None), model, spec, None, GraphBackend("sim"))
    T = spec.num_tokens_per_bs
    for it, sizes in enumerate(schedule):
        dp_sizes = list(sizes) if layout.attn_dp_size > 1 else [sizes[0]]
        g = torch.Generator().manual_seed(seed + 1000 * it + d)
        raw_bs, n = dp_sizes[d], dp_sizes[d] * T
        zeros = torch.zeros(n, dtype=torch.int64)
        inp = VerifyInputs(zeros, zeros, torch.randint(T, 4 * T, (raw_bs,), generator=g), torch.arange(1, raw_bs + 1), dp_sizes)
        if runner.can_run(inp):
            needed = max(dp_sizes) if layout.require_mlp_tp_gather else raw_bs
            check_replay_record(v, layout, runner.prepare_replay(inp), tp_rank, it, needed)


def _logprob_rows_per_request(layout: ParallelLayout, spec: SpecConfig, schedule, model: ModelConfig, d: int, seed: int) -> dict[int, int]:
    """for_logprob of DP group d's step-0 runner divided by its padded bs, per iteration it could replay."""
    runner = _metadata_runners(layout, spec, model, d * layout.attn_tp_size)[0]
    out = {}
    for it, sizes in enumerate(schedule):
        inp = _synthetic_inputs(sizes[d], spec.num_tokens_per_bs, model.hidden_size, list(sizes), seed + 1000 * it + d)
        if not runner.can_run(inp):
            continue
        runner.reset_for_iteration(inp.bs, inp.accept_lens)
        rec = runner.prepare_replay(inp)
        lp = rec.capture.host["global_num_tokens_for_logprob_cpu"]
        out[it] = lp[d if layout.require_mlp_tp_gather else 0] // rec.bs
    return out


def _check_branch_parity(v: Verdict, layout: ParallelLayout, spec: SpecConfig, schedule, model: ModelConfig, seed: int) -> None:
    """I3: the per-rank value is the same in the MLP and attn branches for the same batch.

    The two branches may pad to different buckets (the attn branch's base is attn_tp_size),
    so the comparable quantity is logprob rows per padded request: T in both.
    """
    sib = branch_sibling(layout)
    if sib is None:
        return
    for d in range(layout.attn_dp_size):
        ours = _logprob_rows_per_request(layout, spec, schedule, model, d, seed)
        theirs = _logprob_rows_per_request(sib, spec, schedule, model, d, seed)
        both = sorted(set(ours) & set(theirs))  # iterations both branches could replay (buckets differ)
        ours, theirs = [ours[i] for i in both], [theirs[i] for i in both]
        v.expect_equal(
            "I3", "global_num_tokens_for_logprob",
            {"layout": layout.describe(), "sibling": sib.describe(), "rank": d * layout.attn_tp_size},
            theirs, ours, "logprob rows per padded request differ between the MLP-TP and attn-TP branches",
        )


# ----------------------------------------------------------------------------------------
# P1, run path: what actually reached lm_head (I2), and the graph really replayed
# ----------------------------------------------------------------------------------------


def check_replay_rows(v: Verdict, layout: ParallelLayout, rec: ReplayRecord, tp_rank: int, iteration: int, *, expected_rows: int) -> None:
    """I2 on one replayed record: rows fed to lm_head == this rank's for_logprob == logits rows produced.

    expected_rows: the logits rows the bucket must produce; bs * T for our runners (every
    DRAFT_EXTEND_V2 token), bs for a pruned-logits engine (DESIGN.md §6.3). Shared by
    check_run_metadata and `harness engine-check`.
    """
    w = _where(layout, rec, tp_rank, iteration)
    d = layout.attn_dp_rank(tp_rank)
    lp = rec.global_num_tokens_for_logprob_gpu
    if lp is not None:
        own = lp[d if layout.require_mlp_tp_gather else 0]
        v.expect_equal("I2", "global_num_tokens_for_logprob", w, rec.rows_fed, own, "rows fed to lm_head on this rank")
    v.expect_equal("I2", "rows fed to lm_head", w, rec.logits_rows, rec.rows_fed, "every DRAFT_EXTEND_V2 token needs a logits row")
    v.expect_equal("padding", "logits rows", w, expected_rows, rec.logits_rows)


def check_run_metadata(sc: Scenario, runs: Sequence[RankRun]) -> Verdict:
    """I2 on graph replays: rows fed to lm_head == for_logprob[r] == logits rows produced;
    Σ over DP groups of rows fed == Σ of logits rows; and the same for the eager path."""
    v = Verdict("P1")
    layout, T = sc.layout, sc.spec.num_tokens_per_bs
    for run in runs:
        d = layout.attn_dp_rank(run.rank)
        for it, recs in enumerate(run.records):
            for rec in recs:
                check_replay_rows(v, layout, rec, run.rank, it, expected_rows=rec.bs * T)
        for it, steps in enumerate(run.eager):
            for step, res in enumerate(steps):
                w = {"layout": layout.describe(), "runner": "eager", "rank": run.rank, "iteration": it, "step": step}
                n = res.tensors["logits"].shape[0]
                v.expect_equal("I2", "rows fed to lm_head (eager)", w, n, int(res.tensors["rows_fed"]))
                lp = res.host["global_num_tokens_for_logprob_cpu"]
                if lp is not None:
                    own = lp[d if layout.require_mlp_tp_gather else 0]
                    v.expect_equal("I7", "global_num_tokens_for_logprob (eager)", w, n, own, "our eager path counts tokens, like the graph")
    return v


def check_graph_replayed(sc: Scenario, runs: Sequence[RankRun], expect_fallbacks: int = 0) -> Verdict:
    v = Verdict("P3")
    for run in runs:
        if run.stats is None:
            continue
        w = {"layout": sc.layout.describe(), "rank": run.rank}
        replays = sum(len(r) for r in run.records)
        v.expect_equal("replayed", "graph replays", w, replays, run.stats.replays, "every step of every iteration replayed a graph")
        v.expect_equal("replayed", "eager fallbacks", w, expect_fallbacks, run.stats.eager_fallbacks)
        v.expect_equal("replayed", "replays > 0", w, True, run.stats.replays > 0)
    return v


# ----------------------------------------------------------------------------------------
# tensor comparison shared by P3 and P4
# ----------------------------------------------------------------------------------------

FLOAT_FIELDS = ("logits", "hidden", "logprobs", "topk_p")


def _first_bad_row(ref: torch.Tensor, got: torch.Tensor, tol) -> tuple[int, float] | None:
    if ref.numel() == 0:
        return None
    ref, got = ref.double(), got.double()
    if tol is None:
        bad = ~((ref == got) | (ref.isnan() & got.isnan()))
    else:
        bad = ~torch.isclose(got, ref, rtol=tol.rtol, atol=tol.atol, equal_nan=True)
    if ref.dim() > 1:
        bad = bad.reshape(bad.shape[0], -1).any(dim=1)
    if not bad.any():
        return None
    row = int(bad.nonzero()[0, 0])
    return row, float((ref - got).abs().nan_to_num(float("inf")).max())


def compare_outputs(v: Verdict, check: str, where: dict, ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], tol,
                    row_label=lambda r: f"row {r}") -> bool:
    """Compare float fields with tol (None: bitwise) and top-k ids exactly up to ties of the reference.

    Returns False when top-1 ids differ (a tie flip or a real bug): later steps then see
    different inputs, and the caller stops comparing them.
    """
    same_path = True
    for name in FLOAT_FIELDS:
        v.checked += 1
        if ref[name].shape != got[name].shape:
            v.fail(check, name, where, tuple(ref[name].shape), tuple(got[name].shape), "shape")
            continue
        bad = _first_bad_row(ref[name], got[name], tol)
        if bad is not None:
            row, err = bad
            tol_s = "bitwise" if tol is None else f"rtol={tol.rtol} atol={tol.atol}"
            v.fail(check, name, where, "match", f"differs from {row_label(row) if name in ('logits', 'hidden') else f'request {row}'}",
                   f"first differing {row_label(row) if name in ('logits', 'hidden') else f'request row {row}'}, max |diff| {err:.3g} ({tol_s})")
    v.checked += 1
    ids_ref, ids_got = ref["topk_index"], got["topk_index"]
    if ids_ref.shape != ids_got.shape:
        v.fail(check, "topk_index", where, tuple(ids_ref.shape), tuple(ids_got.shape), "shape")
        return False
    if not torch.equal(ids_ref, ids_got):
        p = ref["logprobs"].exp()
        margin = tol.atol if tol is not None else 0.0
        diff_rows = (ids_ref != ids_got).any(dim=1).nonzero().flatten().tolist()
        for row in diff_rows:
            pr = p[row, ids_ref[row]]
            pg = p[row, ids_got[row]]
            if (pr - pg).abs().max() > margin:
                v.fail(check, "topk_index", where, ids_ref[row].tolist(), ids_got[row].tolist(), f"request row {row}; not a tie of the reference")
                break
        else:
            v.notes.append(f"{check} {where}: top-k tie within tolerance at rows {diff_rows}; later steps not compared")
        same_path = False
    return same_path


# ----------------------------------------------------------------------------------------
# P3: eager vs graph, per draft step, real rows only
# ----------------------------------------------------------------------------------------


def check_eager_vs_graph(sc: Scenario, runs: Sequence[RankRun], device: str = "cpu", tol_override: Optional[Tol] = None) -> Verdict:
    v = Verdict("P3")
    tol = tol_override or eager_vs_graph(device, sc.model.dtype, sc.attention_backend)
    T = sc.spec.num_tokens_per_bs
    for run in runs:
        for it, (eager_steps, graph_steps) in enumerate(zip(run.eager, run.graph, strict=True)):
            recs = run.records[it] if it < len(run.records) else []
            for step, (e, g) in enumerate(zip(eager_steps, graph_steps, strict=True)):
                rec = recs[step] if step < len(recs) else None
                w = {"layout": sc.layout.describe(), "rank": run.rank, "iteration": it, "step": step,
                     "raw_bs": len(run.rids[it]), "bs": rec.bs if rec else "eager"}
                rids = run.rids[it]
                label = lambda r, rids=rids: f"row {r} (request {rids[r // T] if r // T < len(rids) else '?'}, token {r % T})"  # noqa: E731
                if not compare_outputs(v, "eager-vs-graph", w, e.tensors, g.tensors, tol, label):
                    break
                v.checked += 1
                if not torch.equal(e.tensors["next_input_ids"], g.tensors["next_input_ids"]):
                    v.fail("eager-vs-graph", "next_input_ids", w, "equal", "differs")
                    break
    v.merge(check_graph_replayed(sc, runs))
    return v


# ----------------------------------------------------------------------------------------
# P4: every layout against TP1 eager, request by request
# ----------------------------------------------------------------------------------------


def _rows_by_request(run: RankRun, it: int, step_results, T: int) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for i, rid in enumerate(run.rids[it]):
        t = step_results.tensors
        out[rid] = {
            "logits": t["logits"][i * T : (i + 1) * T],
            "hidden": t["hidden"][i * T : (i + 1) * T],
            "logprobs": t["logprobs"][i : i + 1],
            "topk_p": t["topk_p"][i : i + 1],
            "topk_index": t["topk_index"][i : i + 1],
        }
    return out


def check_cross_layout(
    sc: Scenario, runs: Sequence[RankRun], oracle: Sequence[RankRun], runner: str = "eager", tol_override: Optional[Tol] = None
) -> Verdict:
    """P4: each rank's rows equal TP1 eager's rows of the same requests, within CROSS_LAYOUT."""
    v = Verdict("P4")
    tol = tol_override or cross_layout(sc.model.dtype, sc.attention_backend)
    T = sc.spec.num_tokens_per_bs
    ref_run = oracle[0]
    for run in runs:
        results = run.eager if runner == "eager" else run.graph
        for it, steps in enumerate(results):
            diverged: set[int] = set()
            for step, res in enumerate(steps):
                ref = _rows_by_request(ref_run, it, ref_run.eager[it][step], T)
                got = _rows_by_request(run, it, res, T)
                for rid, g in got.items():
                    if rid in diverged:
                        continue
                    w = {"layout": sc.layout.describe(), "runner": runner, "rank": run.rank, "iteration": it, "step": step, "request": rid}
                    label = lambda r, rid=rid: f"row {r} of request {rid} (token {r})"  # noqa: E731
                    if not compare_outputs(v, "vs-tp1", w, ref[rid], g, tol, label):
                        diverged.add(rid)
    return v
