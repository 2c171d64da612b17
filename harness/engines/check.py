"""Our invariants on an engine's own runners: drive the adapter's capture and replay, check the records.

Builds SGLang's multi-layer EAGLE draft-extend graph runner (one per speculative step) and
the single-layer one for a representative layout of every branch (MLP-TP gather, attn-TP
gather, neither), without a model or a GPU; runs the engine's capture path
for every bucket (get_forward_batch(bs) and the step body up to the model) and its replay /
prepare path for every raw batch size up to each bucket; converts what the engine produced
into our records (harness.run.records.CaptureRecord / ReplayRecord) and runs the same P1
checks our runners pass (record_checks.py): I1 capture = replay, I2 rows fed to lm_head =
for_logprob, I3 branch parity, I4 buffer = Σ for_logprob, I5 for_logprob vs num_tokens, I6
single- vs multi-layer, and the padding rules. The graphed draft decode and the target's verify
graphs (sglang/draft_decode.py, sglang/target_verify.py) get the same record and lane checks on
their own lines, and so do, where --runner names them, the speculative graph runners beyond EAGLE's
(sglang/other_runners.py: Frozen-KV MTP, UNO, the ragged verify, DFlash's verify).

What a run checks is an options.Selection: the device paths (sglang/paths.py: which fill code
each replay runs) and the runners. Every call into the engine goes through guard.guarded: a
call that raises is a finding of the check that made it and the others go on. The runners of
the first layout's first DP group are built (construction and capture, before any check) as
the pre-flight: an adapter error there means the adapter cannot drive this release (exit 2).
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from harness.engines.after_model import check_body
from harness.engines.guard import guarded
from harness.engines.install import version_key
from harness.engines.lanes import FILLED_SINCE, LiveBatch, check_lanes, live_batch, schedule
from harness.engines.options import EVERYTHING, FillPath, Selection
from harness.engines.record_checks import check_captures, check_parity, check_record, check_selected_parity
from harness.engines.report import EngineReport, Line
from harness.engines.sglang import draft_decode, eager_check, logits_gather, one_graph, target_verify
from harness.engines.sglang.build import EngineRunners
from harness.engines.sglang.config import EngineConfig
from harness.engines.sglang.errors import EngineAdapterError, MissingEngineAttribute, ReleaseNotCovered
from harness.engines.sglang.handle import ONE_GRAPH
from harness.engines.sglang.loader import Engine
from harness.engines.sglang.other_runners import KINDS as OTHER_KINDS
from harness.engines.sglang.other_runners import OTHER_RUNNERS, OtherRunner
from harness.engines.sglang.paths import FillPlan
from harness.props.p1_records import P1
from harness.ranks.simulated import one_torch_thread
from harness.verdict import Verdict
from runners.base_cuda_graph_runner import compute_capture_bs
from runners.parallel.layout import ParallelLayout

# One or two representative layouts per branch (the branch a layout reaches: ParallelLayout.branch, derived as the engine does).
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



# The runners --runner selects among (the eager path is --eager's).
DEFAULT_RUNNERS: tuple[str, ...] = ("multi_layer", ONE_GRAPH, "single_layer", draft_decode.KIND, target_verify.KIND)
RUNNERS: tuple[str, ...] = (*DEFAULT_RUNNERS, *OTHER_KINDS)
# The speculative graph runners beyond EAGLE's run where --runner names them (docs/engine-check.md, "SGLang's other
# speculative graph runners", says what each finds).
OFF_BY_DEFAULT = ("off unless named, as --eager is: their findings (Frozen-KV MTP's DP bucket from 0.5.14, the ragged verify's DP tier "
                  "from 0.5.16) would change the verdicts the release table and the tests of fixed releases pin")
# In the pre-flight these mean the adapter cannot drive the release; anywhere later, a finding of the check that hit one.
ADAPTER_ERRORS = (EngineAdapterError, MissingEngineAttribute)


class _Book:
    """The report's lines, one per (layout, runner, step, bucket, path)."""

    def __init__(self) -> None:
        self.lines: dict[tuple, Line] = {}

    def line(self, layout: ParallelLayout, runner: str, step: int, bucket: Optional[int], path: str = "") -> Line:
        key = (layout, runner, step, bucket, path)
        if key not in self.lines:
            self.lines[key] = Line(runner, step, layout, bucket, path)
        return self.lines[key]


@dataclass
class _Rank:
    """The first rank of one DP group of a layout: the lines its results go on and its guarded engine calls."""

    book: _Book
    layout: ParallelLayout
    d: int
    tp_rank: int
    path: str  # the per-step composite's path here (paths.FillPlan.line_path)
    plan: FillPlan
    engine_root: str
    preflight: bool
    seen: dict = field(default_factory=dict)  # what the padded lanes held before (lanes.check_lanes)

    def line(self, runner: str, step: int, bucket: Optional[int], path: Optional[str] = None) -> Line:
        return self.book.line(self.layout, runner, step, bucket, _line_path(runner, self.path, self.plan) if path is None else path)

    def call(self, runner: str, call: str, fn: Callable[..., Any], *args: Any, step: int = 0, where: Optional[dict] = None) -> Any:
        """fn(*args), guarded: what it raises is a `raised` failure on the runner's whole-runner line (bucket None)."""
        w = {"layout": self.layout.describe(), "branch": self.layout.branch.value, "runner": runner, "step": step, "rank": self.tp_rank,
             **(where or {})}
        v = Verdict(P1)
        got = guarded(v, call, w, functools.partial(fn, *args), self.engine_root, ADAPTER_ERRORS if self.preflight else ())
        if v.failures:  # the whole-runner line exists only where a call raised (or launched a kernel out of bounds)
            self.line(runner, step, None).verdict.merge(v)
        return got


def _line_path(runner: str, composite_path: str, plan: FillPlan) -> str:
    """The path a runner's lines carry on a rank whose per-step composite replays on composite_path."""
    return composite_path if runner == "multi_layer" else plan.one_graph_path if runner == ONE_GRAPH else ""


@dataclass
class _Built:
    runners: Optional[EngineRunners]
    dd: Optional[draft_decode.DraftDecodeHandle] = None
    tv: Optional[target_verify.TargetVerify] = None


# ----------------------------------------------------------------------------------------
# the check
# ----------------------------------------------------------------------------------------


@one_torch_thread()  # tiny tensors: torch's intra-op pool only spins (harness/ranks/simulated.py)
def check_engine(engine: Engine, layouts: tuple[ParallelLayout, ...] = REPRESENTATIVE_LAYOUTS, cfg: Optional[EngineConfig] = None, progress=None,
                 kernel_layouts: tuple[ParallelLayout, ...] = KERNEL_LAYOUTS, eager: bool = False,
                 selection: Selection = EVERYTHING) -> EngineReport:
    """P1's invariants and the padded-lane checks on a loaded engine's own graph runners, on a CPU (no model, no GPU)."""
    cfg = cfg or EngineConfig()
    t0 = time.perf_counter()
    book = _Book()
    # (layout, rank, runner, step) -> {bucket: (for_logprob per token at capture, rows fed to lm_head per token, bs * T)}, for I3 / I6
    per_request: dict[tuple, dict] = {}
    rank_path: dict[tuple[ParallelLayout, int], str] = {}

    # the buffers whose padded lanes this release's fill writes, per runner (lanes.FILLED_SINCE)
    filled = {kind: frozenset(b for (k, b), since in FILLED_SINCE.items() if k == kind and version_key(since) <= version_key(engine.version))
              for kind in ("multi_layer", "single_layer", draft_decode.KIND, target_verify.KIND)}
    filled[ONE_GRAPH] = filled["multi_layer"]  # the same prepare() fills both composites' buffers
    plan = FillPlan.of(engine.fill, selection.paths, kernel_layouts)

    dd_mod, dd_why = draft_decode.load(engine) if selection.wants(draft_decode.KIND) else (None, "")
    tv_mod, tv_model_runner, tv_why = target_verify.load(engine) if selection.wants(target_verify.KIND) else (None, None, "")
    skipped = list(SKIPPED) + ([] if eager else [I7_OFF])
    skipped += [f"draft_decode (EAGLEDraftCudaGraphRunner): n/a: {dd_why}"] if dd_why else []
    skipped += [f"target_verify (the target's TARGET_VERIFY graphs): n/a: {tv_why}"] if tv_why else []
    na = {k: why for k, why in ((draft_decode.KIND, dd_why), (target_verify.KIND, tv_why)) if selection.runners and k in selection.runners}
    others = []  # the speculative graph runners beyond EAGLE's (sglang/other_runners.py): loaded, or n/a with the reason
    for other in OTHER_RUNNERS:
        if selection.runners is None or other.kind not in selection.runners:  # off unless named (OFF_BY_DEFAULT)
            skipped.append(f"{other.kind} ({other.title}): not checked: {OFF_BY_DEFAULT}; --runner {other.kind} runs it")
        else:
            loaded, why = other.load(engine)
            skipped += [f"{other.kind} ({other.title}): n/a: {why}"] if why else list(other.never)
            others += [] if loaded is None else [(other, loaded)]
            na[other.kind] = why
    # a run whose every named runner is n/a on this release checks nothing: n/a (exit 3), not a pass with no line
    if selection.runners is not None and selection.runners <= set(na) and all(na[k] for k in selection.runners):
        raise ReleaseNotCovered("; ".join(f"{k}: {na[k]}" for k in sorted(selection.runners)))
    gather_na: list[str] = []
    no_gather: list[str] = []  # layouts whose logits processor does not gather across DP groups

    for li, layout in enumerate(layouts):
        if progress:
            progress(f"{layout.describe()}")
        expected_capture_bs = compute_capture_bs(layout, cfg.capture_bs, cfg.max_running_requests)
        wl = {"layout": layout.describe(), "branch": layout.branch.value}
        gather, first, first_rank = None, None, None
        for d in range(layout.attn_dp_size):
            tp_rank = d * layout.attn_tp_size
            own = d if layout.require_mlp_tp_gather else 0
            kernel = plan.kernel_fills(layout, d)
            plan.apply(engine.fill, kernel)
            rank = _Rank(book, layout, d, tp_rank, plan.line_path(kernel), plan, engine.location, preflight=li == 0 and d == 0)
            rank_path[(layout, tp_rank)] = rank.path
            built = _build(engine, rank, cfg, selection.wants(ONE_GRAPH) and plan.one_graph, dd_mod, tv_mod, tv_model_runner)
            rank.preflight = False  # built: from here on every call is a check
            runners = built.runners
            if runners is None:
                continue
            first, first_rank = first or runners, first_rank or rank
            if d == 0:
                got = rank.call("multi_layer", "logits_gather.setup", logits_gather.setup, engine, layout, runners.server_args,
                                cfg.vocab_size, cfg.hidden_size, rank.line("multi_layer", 0, runners.multi[0].capture_bs[0]).verdict, wl)
                gather, why = got if got is not None else (None, None)
                gather_na += [why] if why else []
                no_gather += [layout.describe()] if gather is None and not why and got is not None else []
            for h in runners.handles:
                h.on_launch = None if gather is None else gather.take
            _replay_schedule(rank, runners, gather, filled, cfg, layout in kernel_layouts)
            if runners.one_graph is not None:
                rank.call(ONE_GRAPH, "the one graph's capture restore check", one_graph.check_restore, rank.line, runners.one_graph,
                          {**wl, "runner": ONE_GRAPH, "step": 0, "rank": tp_rank})
            if built.dd is not None:
                rank.call(draft_decode.KIND, "the draft decode's replays", draft_decode.check, built.dd, layout, d, tp_rank, rank.line,
                          filled[draft_decode.KIND])
            for h in runners.handles:
                rank.call(h.kind, "the capture checks", check_captures, h, layout, tp_rank, rank.line, expected_capture_bs, per_request,
                          own, step=h.step)
            if built.tv is not None:
                rank.call(target_verify.KIND, "the target verify's replays", target_verify.check, built.tv, layout, d, tp_rank, rank.line,
                          filled[target_verify.KIND], per_request)
        if eager and first is not None:  # I7: the engine's eager batch for the same loads, against what the graphs baked
            why = first_rank.call(eager_check.KIND, "the eager draft-extend path (I7)", eager_check.check_eager, first, layout,
                                  schedule(layout, first.multi[0].capture_bs), per_request, first_rank.line, gather)
            skipped += [why] if why and why not in skipped else []
        if gather is not None:
            why = first_rank.call("multi_layer", "the logits processor's DP gather", gather.check, first_rank.line, wl)
            gather_na += [why] if why else []
    for other, loaded in others:
        _drive_other(other, loaded, book, layouts, cfg, plan, engine, per_request)
    skipped += sorted(set(gather_na))
    if one_graph.available(engine) and plan.one_graph and selection.wants(ONE_GRAPH):
        skipped.append(ONE_GRAPH_LOGITS if one_graph.flag_on(engine) else ONE_GRAPH_OFF)
        if one_graph.flag_on(engine) and plan.twin and FillPath.NPU in selection.paths:
            skipped.append(ONE_GRAPH_NATIVE)
    if no_gather:
        skipped.append(f"{logits_gather.CHECK} on {', '.join(no_gather)}: nothing to run: the engine's LogitsProcessor does not gather "
                       "logits rows across DP groups there (do_tensor_parallel_all_gather_dp_attn false: no DP attention, or dp lm_head), "
                       "so for_logprob reaches no DP gather (the attn-TP gather layouts, the seed bug's, are among them)")
    check_parity(per_request, layouts, lambda lay, rank, runner, step, bs: book.line(
        lay, runner, step, bs, _line_path(runner, rank_path.get((lay, rank), ""), plan)))
    skipped += plan.skipped(layouts) + selection.left_out(DEFAULT_RUNNERS)
    kept = [ln for ln in book.lines.values() if selection.wants(ln.runner) or ln.runner == eager_check.KIND]
    ordered = sorted(kept, key=lambda ln: (layouts.index(ln.layout) if ln.layout in layouts else len(layouts), ln.runner != "multi_layer", ln.step,
                                           -1 if ln.bucket is None else ln.bucket, ln.path))
    rep = EngineReport("sglang", engine.version, engine.generation, engine.location, ordered, engine.stubbed, time.perf_counter() - t0,
                       skipped, plan.header(engine.version), selection)
    rep.order_failures()  # a line leads with its most severe failure (a crash, a raise, a KV write into a request's slot)
    return rep


def _build(engine: Engine, rank: _Rank, cfg: EngineConfig, with_one_graph: bool, dd_mod: Any, tv_mod: Any, tv_model_runner: Any) -> _Built:
    """Every runner of one rank, constructed and captured before any of its replays (on the first rank: the pre-flight)."""
    runners = rank.call("multi_layer", "building the draft-extend runners (construction and capture)",
                        functools.partial(EngineRunners, one_graph=with_one_graph), engine, rank.layout, rank.tp_rank, cfg)
    if runners is None:
        return _Built(None)
    dd = None if dd_mod is None else rank.call(draft_decode.KIND, "building EAGLEDraftCudaGraphRunner (construction and capture)",
                                               draft_decode.DraftDecodeHandle, dd_mod, runners)
    tv = None if tv_mod is None else rank.call(target_verify.KIND, "building the target's verify graph runner (construction and capture)",
                                               target_verify.TargetVerify, tv_mod, tv_model_runner, runners)
    return _Built(runners, dd, tv)


def _drive_other(other: OtherRunner, loaded: Any, book: _Book, layouts: tuple[ParallelLayout, ...], cfg: EngineConfig, plan: FillPlan,
                 engine: Engine, per_request: dict) -> None:
    """One of the other speculative graph runners on every rank it runs on: built on the rank's stand-ins, then replayed;
    then, per layout, its checks across the layout's DP groups (`finish`)."""
    shared: dict[ParallelLayout, dict] = {}
    ranks: dict[ParallelLayout, _Rank] = {}
    for layout, d, tp_rank in other.ranks(layouts):
        rank = ranks.setdefault(layout, _Rank(book, layout, d, tp_rank, "", plan, engine.location, preflight=False))
        rank = rank if rank.d == d else _Rank(book, layout, d, tp_rank, "", plan, engine.location, preflight=False)
        stand = rank.call(other.kind, "configuring the rank's stand-ins", EngineRunners.stand_ins, engine, layout, tp_rank, cfg)
        built = None if stand is None else rank.call(other.kind, f"building {other.title} (construction and capture)", other.build, loaded, stand)
        if built is not None:
            extra = (shared.setdefault(layout, {}),) if other.finish is not None else ()
            rank.call(other.kind, f"{other.title}'s replays", other.check, built, layout, d, tp_rank, rank.line, per_request, *extra)
    for layout, kept in shared.items():
        first = ranks[layout]
        first.call(other.kind, f"{other.title}: the checks across DP groups", other.finish, layout, kept, first.line)


def _replay_schedule(rank: _Rank, runners: EngineRunners, gather: Optional[logits_gather.GatherCheck], filled: dict, cfg: EngineConfig,
                     kernel_layout: bool) -> None:
    """Every iteration of the schedule through the draft-extend runners, each runner's replay and the checks of its records
    guarded apart (replay first: a line's first failure is then the one our own P1 reports for the same bug, I1)."""
    layout, d = rank.layout, rank.d
    driven: set[int] = set()
    for it, dp_sizes in enumerate(schedule(layout, runners.multi[0].capture_bs)):
        raw = dp_sizes[d]
        needed = max(dp_sizes) if layout.require_mlp_tp_gather else raw
        live = live_batch(raw, dp_sizes, it, cfg.num_draft_tokens, cfg.max_running_requests)
        # past the model call (after_model.py), where the interpreted kernels run, once per full bucket (every row
        # real, the last request's too) and once at raw_bs 1 (the most padding): the body's checks are on the real
        # rows, which no history may change (the padded lanes' history is lanes.py's)
        drive = d == 0 and kernel_layout and raw not in driven and (raw == 1 or raw in runners.multi[0].capture_bs)
        driven |= {raw} if drive else set()
        for h in runners.handles:
            h.drive_body = drive
        if gather is not None:
            gather.where = (it, d, tuple(dp_sizes))
        w_it = {"iteration": it, "raw_bs": raw}
        results = rank.call("multi_layer", "replay_multi_layer (prepare, every step's replay)", runners.replay_multi_layer, live,
                            where=w_it) or []
        results += rank.call(ONE_GRAPH, "replay_one_graph (prepare, the one replay)", runners.replay_one_graph, live, where=w_it) or []
        single = rank.call("single_layer", "replay_single_layer", runners.replay_single_layer, live, where=w_it)
        results += [single] if single is not None else []
        rank.call("multi_layer", "the checks of the iteration's records", _check_iteration, rank, runners, results, live, filled, needed, it,
                  where=w_it)


def _check_iteration(rank: _Rank, runners: EngineRunners, results: list, live: LiveBatch, filled: dict, needed: int, it: int) -> None:
    layout, tp_rank = rank.layout, rank.tp_rank
    bodies = {}
    for rec, returned, lane_recs, body in results:
        ln = rank.line(rec.runner, rec.step, rec.bs)
        check_record(ln, layout, rec, returned, tp_rank, it, needed)
        w = {"layout": layout.describe(), "branch": layout.branch.value, "runner": rec.runner, "step": rec.step, "rank": tp_rank,
             "iteration": it, "raw_bs": rec.raw_bs, "bs": rec.bs}
        for lr in lane_recs:  # the twin's lanes beside the kernel's go on the NPU path's line of the same bucket
            lane_line = ln if lr.path == ln.path else rank.line(rec.runner, rec.step, rec.bs, lr.path)
            lane_line.raw_bs.add(rec.raw_bs)
            lane_line.ranks.add(tp_rank)
            lane_line.tokens_per_bs = rec.tokens_per_bs
            check_lanes(lane_line.verdict, lr, live, rank.seen, w, filled[lr.runner])
        if body is not None:
            prev = bodies.get((rec.runner, rec.step - 1))
            check_body(ln.verdict, body, live.num_correct_drafts, prev, w)
            bodies[(rec.runner, rec.step)] = body
    w_it = {"layout": layout.describe(), "branch": layout.branch.value, "rank": tp_rank, "iteration": it}
    check_selected_parity(bodies, live, rank.line, w_it)
    og = runners.one_graph
    for step, served in enumerate(og.served if og else []):
        h = og.handles[step]
        one_graph.check_served(rank.line(ONE_GRAPH, step, h.snapshots[-1].bs).verdict, step, served, bodies.get((ONE_GRAPH, step)),
                               live.num_correct_drafts, {**w_it, "runner": ONE_GRAPH, "step": step, "raw_bs": live.raw_bs,
                                                         "bs": h.snapshots[-1].bs})
