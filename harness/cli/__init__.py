"""`harness`: list cases, check them, replay one, run the mutant catalog, record/check goldens, add a case."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from typing import Optional, Sequence

from harness import __version__
from harness.case import CaseError, default_cases, load_case
from harness.cli_cases import add_cases_dir, cases_dir, named_cases
from harness.cli_options import enum_option
from harness.cli_ranks import finish, mutant_ctx, quiet, run_command
from harness.errors import ExitCode, UsageError
from harness.outcome import KINDS, Tee, classify, emit_error, wants_json
from harness.ranks import RanksKind
from harness.ranks.joined import check_world
from runners.graph_mode import GraphMode

RANKS_OPTION = enum_option(RanksKind)
RUNNER_OPTION = enum_option(GraphMode, "both")  # both: eager vs graph (P3)


def cmd_list(args) -> int:
    cases = named_cases(args.cases, args)
    if args.json:
        print(json.dumps([{"case": c.name, "layout": c.layout.describe(), "branch": c.layout.branch.value, "world_size": c.layout.world_size,
                           "description": c.description, "path": c.path} for c in cases], indent=2))
        return 0
    width = max(len(c.name) for c in cases)
    for c in cases:
        print(f"{c.name:<{width}}  {c.layout.describe():<48} world={c.layout.world_size}  {c.description}")
    return 0


def cmd_check(args) -> int:
    from harness.checks import check_case, parse_props, require_sim_for_spec_props

    try:
        props = parse_props(args.props)
        require_sim_for_spec_props(props, args.ranks)  # before any case runs
    except ValueError as e:
        raise UsageError(f"harness check: {e}") from None
    cases = named_cases(args.cases, args)
    check_world([(c.name, c.layout) for c in cases])  # launched ranks: each case needs exactly that many
    reports = []
    t0 = time.perf_counter()
    with mutant_ctx(args.mutant):
        for i, case in enumerate(cases, 1):
            rep = check_case(case, props=props, ranks=args.ranks)
            reports.append(rep)
            if not args.json:
                verdicts = " ".join([f"{k}:{'ok' if v.ok else 'FAIL'}" for k, v in rep.verdicts.items()] + [f"{k}:skip" for k in rep.skipped])
                line = f"[{i}/{len(cases)}] {rep.status.upper()} {case.name:<28} {rep.layout:<48} {verdicts}  {rep.seconds:.1f}s"
                print(line, flush=True)
                if not rep.ok:
                    print(f"      {rep.first_failure()[1]}", flush=True)
                for why in dict.fromkeys(rep.skipped.values()):
                    print(f"      skipped {','.join(k for k, w in rep.skipped.items() if w == why)}: {why}", flush=True)
    count = {status: sum(r.status == status for r in reports) for status in ("pass", "fail", "skip")}
    total = time.perf_counter() - t0
    # nothing checked on any case (every requested property skipped): as engine-check's N/A, exit 3, never a pass
    rc = ExitCode.PROPERTY_FAILED if count["fail"] else ExitCode.INTERNAL if not count["pass"] else ExitCode.OK
    if args.json:
        print(json.dumps({"ok": rc is ExitCode.OK, "seconds": round(total, 2), "cases": [r.to_json() for r in reports]}, indent=2, default=str))
    else:
        skipped = f", {count['skip']} skipped (nothing checked)" if count["skip"] else ""
        print(f"{count['pass']} passed, {count['fail']} failed{skipped} in {total:.1f}s")
    return rc


def cmd_replay(args) -> int:
    from harness.replay import check_filters, format_table, replay_case

    case = load_case(args.case, cases_dir(args))
    try:
        check_filters(case, args.step, args.rank)
    except ValueError as e:
        raise UsageError(f"harness replay: {e}") from None
    with mutant_ctx(args.mutant):
        progress = None if args.json else (lambda msg: print(f"... {msg}", file=sys.stderr, flush=True))
        rep = replay_case(case, step=args.step, rank=args.rank, progress=progress, ranks=args.ranks, runner=args.runner)
        if args.dump:
            from harness.dump import dump_case, target_of

            div = rep.first_divergence()
            it, step, why = target_of(div, args.step)
            if progress:
                progress(f"dumping every rank at iteration {it}, step {step} ({why}) to {args.dump}")
            rep.dump = str(dump_case(case, args.dump, it, step, runner=args.runner, why=why, divergence=div))
    if args.json:
        print(json.dumps(rep.to_json(), indent=2, default=str))
    else:
        print(format_table(rep))
    return 0 if rep.ok else 1


def cmd_mutants(args) -> int:
    from harness.mutant_run import run_catalog
    from harness.mutants import CATALOG

    if args.jobs is not None and args.jobs < 1:
        raise SystemExit("harness mutants: --jobs must be >= 1")

    def line(r) -> str:
        if r.status == "error":
            return f"{r.id:<34} ERROR          {r.seconds:6.1f}s  {r.error}"
        status = f"killed by {r.killed_by}" if r.killed else "SURVIVED"
        text = f"{r.id:<34} {status:<14} {r.seconds:6.1f}s  also: {','.join(r.failed_properties[1:]) or '-'}"
        if r.killing_probe:
            text += f"  (probe {r.killing_probe})"
        if r.probes_not_run:
            text += f"  not run: {','.join(r.probes_not_run)}"
        if r.error:
            text += f"\n    error: {r.error}"
        if r.killed:
            text += f"\n    {r.first_failure[:240]}"
        return text

    done, total_n = 0, sum(1 for m in CATALOG if not args.only or m.id in args.only)
    t0 = time.perf_counter()

    def progress(r) -> None:
        nonlocal done
        done += 1
        if not args.json:
            print(f"[{done}/{total_n}] {r.id} {r.status} ({r.killed_by or r.error[:80] or '-'}) {r.seconds:.1f}s, {time.perf_counter() - t0:.0f}s elapsed",
                  file=sys.stderr, flush=True)

    results = run_catalog(args.only or None, on_result=progress, jobs=args.jobs, all_properties=args.all_properties,
                          every_probe=args.all_probes, timeout_s=args.timeout,
                          on_progress=None if args.json else (lambda msg: print(f"... {msg}", file=sys.stderr, flush=True)))
    total = time.perf_counter() - t0
    bad = [r for r in results if not r.killed]
    if args.json:
        print(json.dumps({"seconds": round(total, 2), "all_properties": args.all_properties, "all_probes": args.all_probes, "mutants": [r.to_json() for r in results]}, indent=2))
    else:
        for r in results:
            print(line(r), flush=True)
        errors = sum(r.status == "error" for r in results)
        scope = ("every registered probe" if args.all_probes else "each mutant's probes") + (
            ", all of them" if args.all_properties else ", stopped at its first kill (--all-properties: the full matrix)")
        print(f"{len(results) - len(bad)} killed, {len(bad) - errors} survived, {errors} errors, {len(results)} mutants in {total:.1f}s; {scope}")
    if not results:
        print("no mutant ran", file=sys.stderr)
        return 1
    return 1 if bad else 0


def cmd_new_case(args) -> int:
    from harness.case_template import case_file_path, coverage, new_case, parse_batches
    from runners.config import SpecConfig
    from runners.parallel.layout import LayoutError, ParallelLayout

    target = case_file_path(args.name, args.dir)
    try:
        layout = ParallelLayout(args.tp, args.dp, args.dp > 1, args.dense_tp, args.dp_lm_head, args.a2a)
    except LayoutError as e:
        field, _, rule = str(e).partition(": ")
        raise CaseError(target, field, rule) from None
    try:
        capture_bs = tuple(int(x) for x in args.capture_bs.split(","))
    except ValueError:
        raise CaseError(target, "spec.capture_bs", "comma-separated integers (--capture-bs 1,2,4,8)", args.capture_bs) from None
    spec = SpecConfig(num_steps=args.steps, topk=args.topk, num_draft_tokens=args.tokens_per_bs,
                      capture_bs=capture_bs, max_running_requests=args.max_running_requests)
    batches = parse_batches(args.batches) if args.batches else None
    others = coverage(layout, default_cases())
    path, case = new_case(args.name, layout, spec, batches, args.description, args.seed, args.dir, args.force)
    from harness.golden import show

    print(f"wrote {show(path)}")
    print(f"  layout   {case.layout.describe()}  (world {case.layout.world_size}, attn_tp {case.layout.attn_tp_size}, capture_bs base {case.layout.capture_bs_base})")
    print(f"  schedule {[list(b) for b in case.schedule]}  (per iteration, each DP group's raw bs; 0 = idle)")
    print(f"  same branch and tp/dp already in: {', '.join(others) if others else 'none: this is new coverage'}")
    if args.record:
        from harness.golden.cli import golden_dir
        from harness.golden.lifecycle import record_golden

        print(record_golden(case, golden_dir(args)).format())
        print(f"next: harness check {args.name}, then commit {show(path)} with golden/{args.name}.npz and golden/{args.name}.json")
    else:
        print(f"next: harness check {args.name}  then  harness golden record {args.name}")
    return 0


def cmd_case_schema(args) -> int:
    from harness.case_schema import case_json_schema

    print(json.dumps(case_json_schema(), indent=2))
    return 0


def _add_ranks(s: argparse.ArgumentParser) -> None:
    s.add_argument("--ranks", type=RANKS_OPTION, metavar=RANKS_OPTION.choices_text, default=RanksKind.SIM,
                   help="simulated ranks (threads), or real ones: a process per rank over gloo (CPU) or nccl (a GPU per rank)")


class _Parser(argparse.ArgumentParser):
    """Usage errors become a UsageError, so main() reports them like any bad input (exit 2, JSON under --json)."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="harness", description="Correctness harness for tensor-parallel speculative decoding (EAGLE draft-extend CUDA graphs).",
                epilog="exit codes: 0 every property held, 1 a property failed, 2 bad input or usage, 3 internal error (out of memory included)")
    p.add_argument("--version", action="version", version=f"harness (specharness) {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("list", help="list cases with layout and branch")
    s.add_argument("cases", nargs="*", help="case names or paths (default: every case in cases/)")
    s.add_argument("--json", action="store_true")
    add_cases_dir(s)
    s.set_defaults(func=cmd_list)

    s = sub.add_parser("check", help="run the properties over cases (the main job)")
    s.add_argument("cases", nargs="*", help="case names or paths (default: every case in cases/)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--mutant", help="plant a mutant from the catalog first (see `harness mutants`)")
    _add_ranks(s)
    add_cases_dir(s)
    s.add_argument("--props", default="P1,P3,P4", metavar="LIST",
                   help="properties per case: a comma list of P1,P3,P4 (one run of the runners; the default) and P2,P5,P6 "
                        "(the case's workload through the speculative decoding loop; simulated ranks), or 'all'")
    s.set_defaults(func=cmd_check)

    s = sub.add_parser("replay", help="rerun one case step by step and show the first divergence")
    s.add_argument("case", help="case name (in cases/) or path to a .toml")
    s.add_argument("--step", type=int, help="only this draft step")
    s.add_argument("--rank", type=int, help="only this rank")
    s.add_argument("--mutant", help="plant a mutant first, e.g. sglang-26416")
    _add_ranks(s)
    s.add_argument("--runner", type=RUNNER_OPTION, metavar=RUNNER_OPTION.choices_text, default="both",
                   help="both: eager vs graph (P3) and each vs TP1 (P4); eager or graph: that runner alone vs the TP1 oracle")
    s.add_argument("--dump", metavar="DIR", help="write every rank's buffers and metadata at the first divergence to DIR (np.load-able .npz)")
    s.add_argument("--json", action="store_true")
    add_cases_dir(s)
    s.set_defaults(func=cmd_replay)

    s = sub.add_parser("mutants", help="plant each mutant, run the fast properties, report kills")
    s.add_argument("--only", action="append", metavar="ID", help="run only this mutant (repeatable)")
    s.add_argument("--jobs", "-j", type=int, default=None, metavar="N", help="mutants at once, each in its own process (default: os.cpu_count())")
    s.add_argument("--all-properties", action="store_true",
                   help="run every probe listed for each mutant (the full kill matrix); default: stop at the first probe that kills it")
    s.add_argument("--all-probes", action="store_true",
                   help="ignore each mutant's probe list and run every registered probe (to re-derive the lists after the runners change)")
    s.add_argument("--timeout", type=float, default=300.0, metavar="S", help="seconds per mutant before it is stopped and reported as an error")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_mutants)

    s = sub.add_parser("new-case", help="write cases/<name>.toml for a parallel config (then: harness golden record <name>)")
    s.add_argument("name", help="case name: the file is cases/<name>.toml, its golden golden/<name>.npz")
    s.add_argument("--tp", type=int, required=True, help="tp_size (ranks in all)")
    s.add_argument("--dp", type=int, default=1, help="dp_size; > 1 turns on DP attention")
    s.add_argument("--dense-tp", type=int, choices=(1,), help="moe_dense_tp_size 1 (replicated dense MLP); unset: TP over all ranks")
    s.add_argument("--dp-lm-head", action="store_true", help="enable_dp_lm_head")
    s.add_argument("--a2a", default="none", help="moe_a2a_backend (none, deepep, mooncake, flashinfer)")
    s.add_argument("--steps", type=int, default=3, help="spec num_steps (default 3)")
    s.add_argument("--topk", type=int, default=1)
    s.add_argument("--tokens-per-bs", type=int, help="num_tokens_per_bs (default num_steps + 1)")
    s.add_argument("--capture-bs", default="1,2,4,8", help="comma-separated capture buckets (default 1,2,4,8)")
    s.add_argument("--max-running-requests", type=int, default=8)
    s.add_argument("--batches", help="schedule, e.g. '6,5 3,1 1,0': iterations by spaces, DP groups by commas (default: shrink + idle group)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--description")
    s.add_argument("--dir", help="where to write (default: cases/)")
    s.add_argument("--golden-dir", help="where --record writes (default: golden/)")
    s.add_argument("--force", action="store_true", help="overwrite an existing case file")
    s.add_argument("--record", action="store_true", help="record its golden right away")
    s.set_defaults(func=cmd_new_case)

    s = sub.add_parser("case-schema", help="print the JSON Schema of case files (for editors; the loader checks the rest)")
    s.set_defaults(func=cmd_case_schema)

    from harness import bench, engine_check
    from harness.golden import cli as golden_cli

    bench.add_parser(sub)
    golden_cli.add_parser(sub)
    engine_check.add_parser(sub)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command; the exit code is an ExitCode, and under --json stdout holds exactly one JSON document."""
    return finish(_main(argv))


def _main(argv: Optional[Sequence[str]]) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = wants_json(argv) and not quiet()
    out, err = Tee(sys.stdout), Tee(sys.stderr, keep_error=True)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = _run(argv)
    except SystemExit as e:  # --help, --version (code 0); a command that exits with a message is a usage error
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        msg = str(e.code).removeprefix("error: ")
        if not quiet():
            emit_error(ExitCode.BAD_INPUT, "usage", msg, as_json)
        return ExitCode.BAD_INPUT
    except BrokenPipeError:  # `harness list | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.OK
    except Exception as e:  # noqa: BLE001 - every error becomes an exit code and a message, never a bare traceback
        code, kind, msg = classify(e)
        if code is ExitCode.INTERNAL and kind == "internal":
            traceback.print_exc(file=sys.stderr)  # ours to fix: the report needs the traceback
        if kind == "internal" or not quiet():  # launched ranks but 0: rank 0 reports what they all saw
            emit_error(code, kind, msg, as_json)
        return code
    if as_json and rc and not out.wrote:  # a command that reported its error on stderr only
        code = ExitCode(rc) if rc in (1, 2, 3) else ExitCode.INTERNAL
        emit_error(code, KINDS[code], err.last_error or f"exit {rc}; see stderr", True, to_stderr=False)
    return rc


def _run(argv: Sequence[str]) -> int:
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
