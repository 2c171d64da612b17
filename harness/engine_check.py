"""`harness engine-check --engine sglang[==VERSION] [--json]`: our P1 invariants on the engine's own runners.

Builds SGLang's multi-layer EAGLE draft-extend graph runner (one per speculative step) and
the single-layer one for a representative layout of every branch of DESIGN.md §6 (MLP-TP
gather, attn-TP gather, neither), without a model or a GPU; runs the engine's capture path
for every bucket (get_forward_batch(bs) and the step body up to the model) and its replay /
prepare path for every raw batch size up to each bucket; converts what the engine produced
into our records (runners.cuda_graph.CaptureRecord / ReplayRecord) and runs the same P1
checks our runners pass: I1 capture = replay, I2 rows fed to lm_head = for_logprob, I3
branch parity, I4 buffer = Σ for_logprob, I5 for_logprob vs num_tokens, I6 single- vs
multi-layer, and the padding rules. One line per (runner, layout/branch, bucket), then a
verdict. Exit 0: every check held; 1: a check failed; 2: the engine could not be checked
(not installed, or the adapter cannot drive this release: the message says what moved).

Every SGLang-specific stub and shim lives in harness/engine_adapter.py; installs come from
harness/engine_install.py (`python -m harness.engine_install sglang==X`, or --install here).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Optional

from harness.engine_install import (
    EngineSpec,
    InstallError,
    deps_dir,
    engine_dir,
    ensure_installed,
    installed_versions,
    is_installed,
)
from harness.layout import all_layouts, branch_sibling
from harness.properties import check_replay_record, check_replay_rows
from harness.verdict import Failure, Verdict
from runners.cuda_graph import ReplayRecord, compute_capture_bs
from runners.parallel.layout import Branch, ParallelLayout

# One or two representative layouts per branch (DESIGN.md §6.1, "which layouts reach which branch").
REPRESENTATIVE_LAYOUTS: tuple[ParallelLayout, ...] = (
    ParallelLayout(4, 2, True),  # MLP-TP gather: DP attention with default flags
    ParallelLayout(4, 1, False, 1),  # attn-TP gather (i): no DP attention, moe_dense_tp_size = 1
    ParallelLayout(4, 2, True, 1, True, "deepep"),  # attn-TP gather (ii): DP attention, dp < tp, dense 1, dp lm_head, a2a
    ParallelLayout(4),  # neither: plain TP
    ParallelLayout(4, 4, True, 1, True, "deepep"),  # neither: DP attention with dp = tp and the flags of (ii)
)


@dataclass
class Line:
    """One (runner, layout, bucket): every replay that landed in the bucket, on every rank checked."""

    runner: str
    step: int
    layout: ParallelLayout
    bucket: int
    tokens_per_bs: int = 0
    verdict: Verdict = field(default_factory=lambda: Verdict("P1"))
    raw_bs: set[int] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)
    pruned: bool = False

    @property
    def label(self) -> str:
        return f"{self.runner}[{self.step}]" if self.runner == "multi_layer" else self.runner

    def to_json(self) -> dict:
        return {
            "runner": self.runner, "step": self.step, "branch": self.layout.branch.value, "layout": self.layout.describe(),
            "bucket": self.bucket, "tokens_per_bs": self.tokens_per_bs, "raw_bs": sorted(self.raw_bs), "ranks": sorted(self.ranks),
            "pruned_logits": self.pruned, "ok": self.verdict.ok, "checked": self.verdict.checked,
            "failures": [asdict(f) for f in self.verdict.failures], "notes": list(self.verdict.notes),
        }


@dataclass
class EngineReport:
    engine: str
    version: str
    generation: str
    location: str
    lines: list[Line]
    stubbed: list[str]
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(line.verdict.ok for line in self.lines)

    def failures(self) -> list[Failure]:
        return [f for line in self.lines for f in line.verdict.failures]

    def to_json(self) -> dict:
        failed = [ln for ln in self.lines if not ln.verdict.ok]
        return {
            "engine": self.engine, "version": self.version, "api": self.generation, "location": self.location, "ok": self.ok,
            "seconds": round(self.seconds, 2), "stubbed_modules": self.stubbed,
            "summary": {"lines": len(self.lines), "failed_lines": len(failed), "checks": sum(ln.verdict.checked for ln in self.lines),
                        "failures": len(self.failures()), "notes": sum(len(ln.verdict.notes) for ln in self.lines)},
            "lines": [ln.to_json() for ln in self.lines],
        }


# ----------------------------------------------------------------------------------------
# the schedule of live batches
# ----------------------------------------------------------------------------------------


def _schedule(layout: ParallelLayout, capture_bs: list[int], d: int) -> list[list[int]]:
    """Per iteration, each DP group's raw batch size: every size up to the largest bucket, growing then
    shrinking (so a smaller batch follows a larger one and finds its stale lanes). In the MLP-TP branch
    the bucket follows the largest group: each size also runs with this group the small one."""
    top = max(capture_bs)
    sizes = list(range(1, top + 1))
    sizes = sizes + sizes[::-1][1:]
    dp = layout.attn_dp_size
    out = []
    for r in sizes:
        out.append([r] * dp)
        if layout.require_mlp_tp_gather and dp > 1 and r > 1:
            out.append([1 if g == d else r for g in range(dp)])
    return out


def _seq_lens(raw_bs: int, it: int) -> list[int]:
    return [5 + (3 * i + it) % 11 for i in range(raw_bs)]


def _accept_lens(raw_bs: int, it: int, T: int) -> list[int]:
    return [1 + (i + it) % T for i in range(raw_bs)]


# ----------------------------------------------------------------------------------------
# the check
# ----------------------------------------------------------------------------------------


def check_engine(engine: Any, layouts: tuple[ParallelLayout, ...] = REPRESENTATIVE_LAYOUTS, cfg: Any = None, progress=None) -> EngineReport:
    from harness import engine_adapter as ea

    cfg = cfg or ea.EngineConfig()
    t0 = time.perf_counter()
    lines: dict[tuple, Line] = {}
    # (layout, rank, runner, step) -> {bucket: (for_logprob per token at capture, rows fed to lm_head per token, bs * T)}, for I3 / I6
    per_request: dict[tuple, dict[int, tuple[Optional[Fraction], Fraction, int]]] = {}

    def line(layout: ParallelLayout, runner: str, step: int, bucket: int) -> Line:
        key = (layout, runner, step, bucket)
        if key not in lines:
            lines[key] = Line(runner, step, layout, bucket)
        return lines[key]

    for layout in layouts:
        if progress:
            progress(f"{layout.describe()}")
        expected_capture_bs = compute_capture_bs(layout, cfg.capture_bs, cfg.max_running_requests)
        for d in range(layout.attn_dp_size):
            tp_rank = d * layout.attn_tp_size
            own = d if layout.require_mlp_tp_gather else 0
            runners = ea.EngineRunners(engine, layout, tp_rank, cfg)
            # replay first: a line's first failure is then the one our own P1 reports for the same bug (I1)
            sched = _schedule(layout, runners.multi[0].capture_bs, d)
            for it, dp_sizes in enumerate(sched):
                raw = dp_sizes[d]
                needed = max(dp_sizes) if layout.require_mlp_tp_gather else raw
                live = ea.LiveBatch(raw, dp_sizes, _seq_lens(raw, it), _accept_lens(raw, it, cfg.num_draft_tokens))
                results = runners.replay_multi_layer(live) + [runners.replay_single_layer(live)]
                for rec, returned in results:
                    _check_record(line(layout, rec.runner, rec.step, rec.bs), layout, rec, returned, tp_rank, it, needed)
            for h in runners.handles:
                for bs in h.capture_bs:
                    ln = line(layout, h.kind, h.step, bs)
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
                    v.expect_equal("padding", "dp_padding_mode", w, "max_len", host["dp_padding_mode"], "draft-extend graphs pad every DP rank to the bucket")
                    v.expect_equal("padding", "local_dp_buffer_len", w, n, host["local_dp_buffer_len"], "the step body's DP buffer holds bs * T tokens")
                    if host["extend_num_tokens"] is not None:  # the single-layer runner leaves it unset
                        v.expect_equal("padding", "extend_num_tokens", w, n, host["extend_num_tokens"])
                    for name in ("global_num_tokens_cpu", "global_dp_buffer_len"):
                        if host[f"fb_{name}"] is not None:
                            v.expect_equal("capture", name, w, host[name], host[f"fb_{name}"], "forward batch vs the step body's set_dp_buffer_len")
                    if cap.global_num_tokens_for_logprob_gpu is not None:
                        v.expect_equal("I2", "global_num_tokens_for_logprob_gpu (capture)", w, rows_fed, cap.global_num_tokens_for_logprob_gpu[own],
                                       "rows fed to lm_head in the warm-up and capture runs")
                    lp = cap.global_num_tokens_for_logprob_gpu
                    per_request.setdefault((layout, tp_rank, h.kind, h.step), {})[bs] = (
                        None if lp is None else Fraction(lp[own], n), Fraction(rows_fed, n), n)
    _check_parity(lines, per_request, layouts, line)
    ordered = sorted(lines.values(), key=lambda ln: (layouts.index(ln.layout), ln.runner != "multi_layer", ln.step, ln.bucket))
    return EngineReport("sglang", engine.version, engine.generation, engine.location, ordered, engine.stubbed, time.perf_counter() - t0)


def _check_record(ln: Line, layout: ParallelLayout, rec: ReplayRecord, returned: Optional[int], tp_rank: int, it: int, needed: int) -> None:
    v = ln.verdict
    ln.raw_bs.add(rec.raw_bs)
    ln.ranks.add(tp_rank)
    n = rec.bs * rec.tokens_per_bs
    pruned = rec.rows_fed == rec.bs and n != rec.bs  # measured: the engine's logits processor feeds lm_head one row per request
    check_replay_record(v, layout, rec, tp_rank, it, needed, logprob_rows=rec.bs if pruned else None, require_host_lists=False)
    check_replay_rows(v, layout, rec, tp_rank, it, expected_rows=rec.bs if pruned else n)
    w = {"layout": layout.describe(), "branch": rec.branch, "runner": rec.runner, "step": rec.step, "rank": tp_rank, "iteration": it,
         "raw_bs": rec.raw_bs, "bs": rec.bs}
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
        # I6
        if kind != "multi_layer":
            continue
        single = per_request.get((layout, rank, "single_layer", 0), {})
        for bs, (lp, rows, n) in buckets.items():
            if bs not in single:
                continue
            w = {"layout": layout.describe(), "branch": layout.branch.value, "runner": kind, "step": step, "rank": rank, "bs": bs}
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
            f"P1/{check} global_num_tokens_for_logprob: {_fmt(r_lp, r_n)} vs {_fmt(g_lp, g_n)}, each equal to the rows its runner feeds lm_head: "
            f"the pruned-logits variant of DESIGN.md §6.3 (legal; reported) [{', '.join(f'{k}={x}' for k, x in w.items())}]"
        )
    else:
        v.fail(check, "global_num_tokens_for_logprob", w, _fmt(r_lp, r_n), _fmt(g_lp, g_n), what)


def _fmt(x: Optional[Fraction], n: int) -> str:
    if x is None:
        return "absent"
    return f"{x * n} of {n} tokens" if x != 1 else f"all {n} tokens"


# ----------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------


def format_report(rep: EngineReport, cfg: Any) -> str:
    try:
        where = str(Path(rep.location).resolve().relative_to(Path.cwd().resolve())) or "."
    except ValueError:
        where = rep.location
    out = [f"engine-check: sglang {rep.version} ({rep.generation} API) from {where}",
           f"  EAGLE draft-extend graph runners: num_steps={cfg.num_steps} topk={cfg.topk} num_draft_tokens={cfg.num_draft_tokens} "
           f"capture_bs={list(cfg.capture_bs)} max_running_requests={cfg.max_running_requests}; no model, no GPU",
           f"  stubbed imports: {', '.join(rep.stubbed)}"]
    lw = max(len(_layout_name(ln.layout)) for ln in rep.lines)
    for ln in rep.lines:
        v = ln.verdict
        raw = sorted(ln.raw_bs)
        raws = f"{raw[0]}..{raw[-1]}" if raw else "-"
        head = (f"{'ok  ' if v.ok else 'FAIL'} {ln.label:<15} {ln.layout.branch.value:<14} {_layout_name(ln.layout):<{lw}} bs={ln.bucket:<3} "
                f"T={ln.tokens_per_bs} raw_bs {raws:<6} ranks {','.join(map(str, sorted(ln.ranks))):<8}")
        if v.ok:
            tail = f"{v.checked} checks" + (" (pruned logits)" if ln.pruned else "") + (f"; {len(v.notes)} note(s)" if v.notes else "")
        else:
            more = f" (+{len(v.failures) - 1} more)" if len(v.failures) > 1 else ""
            tail = v.failures[0].message() + more
        out.append(f"{head} {tail}")
    groups: dict[tuple, list[str]] = {}
    for ln in rep.lines:
        for n in ln.verdict.notes:
            groups.setdefault((n.split(" ", 1)[0], ln.layout.branch.value), []).append(n)
    if groups:
        out.append(f"notes ({sum(map(len, groups.values()))}; the first of each check and branch, then the count):")
        for (_check, branch), ns in groups.items():
            out.append(f"  {ns[0]}" + (f" (+{len(ns) - 1} like it in {branch})" if len(ns) > 1 else ""))
    failed = [ln for ln in rep.lines if not ln.verdict.ok]
    checks = sum(ln.verdict.checked for ln in rep.lines)
    if failed:
        fields = sorted({(f.check, f.field, f.where.get("branch")) for f in rep.failures()})
        out.append("failing (check, field, branch): " + "; ".join(f"{c} {fl} [{b}]" for c, fl, b in fields))
        out.append(f"verdict: FAIL: {len(failed)} of {len(rep.lines)} (runner, branch, bucket) lines failed, {len(rep.failures())} failures in "
                   f"{checks} checks ({rep.seconds:.1f}s); first: {rep.failures()[0].message()}")
    else:
        out.append(f"verdict: PASS: {len(rep.lines)} (runner, branch, bucket) lines, {checks} checks ({rep.seconds:.1f}s)")
    return "\n".join(out)


def _layout_name(layout: ParallelLayout) -> str:
    return layout.describe().split(" [")[0]


# ----------------------------------------------------------------------------------------
# the command
# ----------------------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "engine-check",
        help="run the P1 invariants on an installed SGLang's draft-extend graph runners (CPU, no model)",
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(p)
    p.set_defaults(func=main)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", required=True, help="sglang or sglang==VERSION")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.add_argument("--target", metavar="DIR", help="the sglang install to check (a pip --target dir); default .engines/sglang-VERSION")
    p.add_argument("--deps", metavar="DIR", help="where msgspec/dill/regex/packaging live (default .engines/deps)")
    p.add_argument("--install", action="store_true", help="install sglang==VERSION into the default place first if it is missing")
    p.add_argument("--all-layouts", action="store_true", help="every valid layout up to tp8, not one or two per branch")


def _resolve(args) -> tuple[Optional[Path], Optional[Path]]:
    spec = EngineSpec.parse(args.engine)
    deps = Path(args.deps) if args.deps else deps_dir()
    if args.target:
        return Path(args.target), deps
    if spec.version is not None:
        target = engine_dir(spec.version)
        if not is_installed(target):
            if not args.install:
                raise FileNotFoundError(f"sglang=={spec.version} is not installed at {target}: run `python -m harness.engine_install {spec}` or pass --install")
            ensure_installed(spec.version, log=lambda m: print(m, file=sys.stderr))
        return target, deps
    if importlib.util.find_spec("sglang") is not None:
        return None, deps  # the environment's own sglang
    versions = installed_versions()
    if not versions:
        raise FileNotFoundError("no sglang in this environment and none under .engines/: give --engine sglang==VERSION --install")
    return engine_dir(versions[-1]), deps


def main(args) -> int:
    from harness import engine_adapter as ea

    try:
        spec = EngineSpec.parse(args.engine)
        target, deps = _resolve(args)
    except (FileNotFoundError, ValueError, InstallError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = None
    try:
        engine = ea.load(target, deps)
        if spec.version is not None and engine.version != spec.version:
            raise ea.EngineAdapterError(f"asked for sglang=={spec.version}, found {engine.version} at {engine.location}")
        layouts = all_layouts(8) if args.all_layouts else REPRESENTATIVE_LAYOUTS
        progress = None if args.json else (lambda m: print(f"... {m}", file=sys.stderr, flush=True))
        cfg = ea.EngineConfig()
        rep = check_engine(engine, tuple(layouts), cfg, progress)
    except (ea.EngineAdapterError, ea.MissingEngineAttribute) as e:
        print(f"error: the engine adapter cannot drive this release: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the engine's own code raised while being driven: not a verdict either way
        import traceback

        traceback.print_exc()
        what = engine.describe() if engine is not None else str(spec)
        print(f"error: driving {what} raised {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rep.to_json(), indent=2, default=str))
    else:
        print(format_report(rep, cfg))
    return 0 if rep.ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m harness.engine_check", description=__doc__.split("\n\n")[0])
    _add_arguments(parser)
    sys.exit(main(parser.parse_args()))
