"""`harness check`: the properties over cases, one line per case, a summary, exit 0/1; a failed run ends with each
failed case and the command that replays it. `-k` and `--lf` select cases as pytest selects tests (harness.cli.select)."""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Iterator, Optional, Sequence

from harness.cases.case import CASES_DIR, Case
from harness.cli.cases import add_cases_dir, cases_dir, named_cases
from harness.cli.options import add_ranks
from harness.cli.ranks import mutant_ctx, quiet
from harness.cli.select import select, update_last_failed
from harness.errors import ExitCode, UsageError
from harness.props import registry
from harness.ranks import RanksKind, forkserver
from harness.ranks.joined import check_world
from harness.run.case_run import RUN
from harness.verdict import Failure


def _replayed() -> tuple[str, ...]:
    """What `harness replay` reruns step by step: the run and the properties of one case run (the loop's rerun under check)."""
    return (RUN,) + registry.default_ids()


def _first_failure(rep) -> Optional[Failure]:
    order = registry.report_order()  # the run first, then the properties in registry order
    for name in sorted(rep.verdicts, key=lambda k: (order.index(k) if k in order else len(order), k)):
        if rep.verdicts[name].failures:
            return rep.verdicts[name].failures[0]
    return None


def next_command(rep, case: Case, args) -> str:
    """The copy-paste command that shows a failed case's first failure: replay at its step and rank, or check of its
    loop property."""
    f = _first_failure(rep)
    in_dir = Path(case.path).parent.resolve() == cases_dir(args).resolve()
    words = [case.name if in_dir else case.path]
    if in_dir and cases_dir(args).resolve() != CASES_DIR.resolve():
        words += ["--cases-dir", str(cases_dir(args))]
    if f is None or f.prop in _replayed():
        head = ["harness", "replay"]
        for key in ("step", "rank"):
            if f is not None and isinstance(f.where.get(key), int):
                words += [f"--{key}", str(f.where[key])]
    else:
        head = ["harness", "check"]
        words += ["--props", f.prop]
    if args.mutant:
        words += ["--mutant", args.mutant]
    if str(args.ranks) != "sim":
        words += ["--ranks", str(args.ranks)]
    return shlex.join(head + words)


_worker_plants = contextlib.ExitStack()  # a worker's planted mutant, for the worker's life


def _worker_init(mutant_id: Optional[str]) -> None:
    """A case worker: the mutant planted as in the parent (each process runs its own copy of the code). Its ranks run
    on one torch thread each already (harness.ranks.simulated.one_torch_thread), so workers never contend for cores."""
    _worker_plants.enter_context(mutant_ctx(mutant_id))


def _check_in_worker(case: Case, props: tuple[str, ...], ranks: str):
    rep = check_case_in_process(case, props, ranks, None)
    rep.runs = rep.oracle = None  # the runs' tensors stay in the worker: the report is what the parent prints
    return rep


def jobs_for(args, cases: Sequence[Case]) -> int:
    """Cases at once: --jobs, else one per core; one where the ranks are processes of their own (they take the cores)
    or a single case is run (its progress shows)."""
    if args.jobs is not None:
        if args.jobs < 1:
            raise UsageError(f"harness check: --jobs must be >= 1 (got {args.jobs})")
        return min(args.jobs, len(cases))
    if RanksKind.parse(args.ranks) is not RanksKind.SIM or len(cases) < 2:
        return 1
    return min(os.cpu_count() or 1, len(cases))


def _reports(cases: Sequence[Case], props: tuple[str, ...], args, jobs: int, progress) -> Iterator:
    """Each case's report, in the cases' order. With several jobs the cases run in forked workers, the largest worlds
    first (they take longest), and a report is yielded as soon as it and every report before it are in."""
    if jobs == 1:
        for case in cases:
            yield check_case_in_process(case, props, args.ranks, progress)
        return
    ctx = forkserver.context(["harness.pipeline.check", "harness.mutants"])
    with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker_init, initargs=(args.mutant,)) as pool:
        order = sorted(range(len(cases)), key=lambda i: -cases[i].layout.world_size)
        futures: dict[int, Future] = {i: pool.submit(_check_in_worker, cases[i], props, str(args.ranks)) for i in order}
        for i in range(len(cases)):
            try:
                yield futures[i].result()
            except BrokenProcessPool as e:
                running = ", ".join(c.name for j, c in enumerate(cases) if not futures[j].done())
                raise RuntimeError(f"harness check: a case worker died (a crash in native code?) while these cases ran: {running}; "
                                   f"rerun one with --jobs 1 to see it") from e


def check_case_in_process(case: Case, props: tuple[str, ...], ranks, progress):
    from harness.pipeline.check import check_case  # torch: only when a check runs
    return check_case(case, props=props, ranks=ranks, on_progress=progress)


def cmd_check(args) -> int:
    from harness.pipeline.check import parse_props, require_ranks  # torch: only when a check runs
    try:
        props = parse_props(args.props)
        require_ranks(props, args.ranks)  # before any case runs
    except ValueError as e:
        raise UsageError(f"harness check: {e}") from None
    cases, selected = select(named_cases(args.cases, args), args.keyword, args.last_failed)
    if selected and not args.json:
        print(selected, flush=True)
    check_world([(c.name, c.layout) for c in cases])  # launched ranks: each case needs exactly that many
    jobs = jobs_for(args, cases)
    reports = []
    t0 = time.perf_counter()
    # what runs, on stderr, where a run is long: one case alone, or properties beyond the default (the loop's)
    long_run = len(cases) == 1 or set(props) - set(registry.default_ids())
    progress = None if args.json or not long_run or jobs > 1 else (lambda msg: print(f"... {msg}", file=sys.stderr, flush=True))
    if not args.json and args.props and args.props.strip().lower() == "all":
        print(f"... all the case properties ({','.join(props)}); not per case: {registry.elsewhere_note()}", file=sys.stderr, flush=True)
    if not args.json and jobs > 1:
        print(f"... {len(cases)} cases, {jobs} at once (--jobs 1: one after another, with each case's progress)", file=sys.stderr, flush=True)
    with mutant_ctx(args.mutant):
        for i, (case, rep) in enumerate(zip(cases, _reports(cases, tuple(props), args, jobs, progress), strict=True), 1):
            reports.append(rep)
            if not args.json:
                verdicts = " ".join([f"{k}:{'ok' if v.ok else 'FAIL'}" for k, v in rep.verdicts.items()] + [f"{k}:skip" for k in rep.skipped])
                line = f"[{i}/{len(cases)}] {rep.status.upper()} {case.name:<28} {rep.layout:<48} {verdicts}  {rep.seconds:.1f}s"
                print(line, flush=True)
                if not rep.ok:
                    print(f"      {rep.first_failure()[1]}", flush=True)
                for why in dict.fromkeys(rep.skipped.values()):
                    print(f"      skipped {','.join(k for k, w in rep.skipped.items() if w == why)}: {why}", flush=True)
    if not quiet():
        update_last_failed((c, r.status != "fail") for c, r in zip(cases, reports, strict=True))
    count = {status: sum(r.status == status for r in reports) for status in ("pass", "fail", "skip")}
    total = time.perf_counter() - t0
    failed = [(c, r) for c, r in zip(cases, reports, strict=True) if r.status == "fail"]
    # nothing checked on any case (every requested property skipped): as engine-check's N/A, exit 3, never a pass
    rc = ExitCode.PROPERTY_FAILED if count["fail"] else ExitCode.INTERNAL if not count["pass"] else ExitCode.OK
    if args.json:
        cases_json = [dict(r.to_json(), **({"next": next_command(r, c, args)} if r.status == "fail" else {})) for c, r in zip(cases, reports, strict=True)]
        print(json.dumps({"ok": rc is ExitCode.OK, "seconds": round(total, 2), "cases": cases_json}, indent=2, default=str))
        return rc
    if failed:
        print(f"\nfailed ({len(failed)}), each with the command that shows its first failure:")
        width = max(len(c.name) for c, _ in failed)
        for c, r in failed:
            prop = _first_failure(r)
            print(f"  {c.name:<{width}}  {prop.prop + '/' + prop.check if prop else ''}")
            print(f"    {next_command(r, c, args)}")
        print("rerun only these: harness check --lf" + (f" --mutant {shlex.quote(args.mutant)}" if args.mutant else ""))
    skipped = f", {count['skip']} skipped (nothing checked)" if count["skip"] else ""
    print(f"{count['pass']} passed, {count['fail']} failed{skipped} in {total:.1f}s")
    return rc


def add_parser(subparsers) -> None:
    s = subparsers.add_parser("check", help="run the properties over cases (the main job)")
    s.add_argument("cases", nargs="*", help="case names or paths (default: every case in --cases-dir)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--mutant", help="plant a mutant from the catalog first (see `harness mutants --list`)")
    s.add_argument("-k", dest="keyword", metavar="EXPRESSION",
                   help="only the cases whose names match, as pytest -k: words (substrings), and, or, not, parentheses")
    s.add_argument("--lf", "--last-failed", dest="last_failed", action="store_true",
                   help="only the cases that failed last time (all when none did; kept in ./.specharness_cache/)")
    s.add_argument("--jobs", "-j", type=int, default=None, metavar="N",
                   help="cases at once, each in its own process (default: one per core on simulated ranks; 1 for real ranks)")
    add_ranks(s)
    add_cases_dir(s)
    s.add_argument("--props", default=None, metavar="LIST", help=registry.props_help())
    s.set_defaults(func=cmd_check)
