"""`harness check`: the properties over cases, one line per case, a summary, exit 0/1."""
from __future__ import annotations

import json
import sys
import time

from harness.cli.cases import add_cases_dir, named_cases
from harness.cli.options import add_ranks
from harness.cli.ranks import mutant_ctx
from harness.errors import ExitCode, UsageError
from harness.props import registry
from harness.ranks.joined import check_world


def cmd_check(args) -> int:
    from harness.pipeline.check import check_case, parse_props, require_ranks  # torch: only when a check runs
    try:
        props = parse_props(args.props)
        require_ranks(props, args.ranks)  # before any case runs
    except ValueError as e:
        raise UsageError(f"harness check: {e}") from None
    cases = named_cases(args.cases, args)
    check_world([(c.name, c.layout) for c in cases])  # launched ranks: each case needs exactly that many
    reports = []
    t0 = time.perf_counter()
    # what runs, on stderr, where a run is long: one case alone, or properties beyond the default (the loop's)
    long_run = len(cases) == 1 or set(props) - set(registry.default_ids())
    progress = None if args.json or not long_run else (lambda msg: print(f"... {msg}", file=sys.stderr, flush=True))
    if not args.json and args.props and args.props.strip().lower() == "all":
        print(f"... all the case properties ({','.join(props)}); not per case: {registry.elsewhere_note()}", file=sys.stderr, flush=True)
    with mutant_ctx(args.mutant):
        for i, case in enumerate(cases, 1):
            rep = check_case(case, props=props, ranks=args.ranks, on_progress=progress)
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


def add_parser(subparsers) -> None:
    s = subparsers.add_parser("check", help="run the properties over cases (the main job)")
    s.add_argument("cases", nargs="*", help="case names or paths (default: every case in cases/)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--mutant", help="plant a mutant from the catalog first (see `harness mutants`)")
    add_ranks(s)
    add_cases_dir(s)
    s.add_argument("--props", default=None, metavar="LIST", help=registry.props_help())
    s.set_defaults(func=cmd_check)
