"""`harness golden record|check`: the array goldens of the cases (golden/<case>.npz + .json)."""
from __future__ import annotations

import argparse
import json
import sys
import time

from harness.cli_cases import add_cases_dir, cases_dir, named_cases
from harness.cli_ranks import mutant_ctx
from harness.golden.base import GOLDEN_DIR, GoldenError, GoldenFormatError
from harness.golden.lifecycle import check_golden, iter_cases, record_golden, refuse_under_xdist


def golden_dir(args):
    return args.golden_dir or GOLDEN_DIR


def cmd_golden_record(args) -> int:
    refuse_under_xdist(golden_dir(args))
    cases = iter_cases(args.cases, args.all, cases_dir(args))
    t0 = time.perf_counter()
    changed = 0
    for i, case in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] recording {case.name} ({case.layout.describe()})", file=sys.stderr, flush=True)
        res = record_golden(case, golden_dir(args))
        changed += res.status != "unchanged"
        print(res.format(), flush=True)
    print(f"{len(cases)} golden(s): {changed} written, {len(cases) - changed} unchanged in {time.perf_counter() - t0:.1f}s")
    return 0


def cmd_golden_check(args) -> int:
    cases = named_cases(args.cases, args)
    t0 = time.perf_counter()
    results, failed = [], 0
    for i, case in enumerate(cases, 1):
        t = time.perf_counter()
        try:
            with mutant_ctx(args.mutant):
                cmp = check_golden(case, golden_dir(args))
            ok, text, data = cmp.ok, cmp.format(limit=args.limit), cmp.to_json()
        except GoldenFormatError:
            raise  # a malformed golden is bad input (exit 2), not a difference
        except GoldenError as e:
            ok, text, data = False, f"{case.name}: {e}", {"case": case.name, "ok": False, "error": str(e)}
        failed += not ok
        data["seconds"] = round(time.perf_counter() - t, 3)
        results.append(data)
        if not args.json:
            head, _, rest = text.partition("\n")
            print(f"[{i}/{len(cases)}] {'PASS' if ok else 'FAIL'} {head}  {data['seconds']:.1f}s", flush=True)
            if rest:
                print(rest, flush=True)
    total = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"ok": not failed, "seconds": round(total, 2), "cases": results}, indent=2, default=str))
    else:
        print(f"{len(cases) - failed} passed, {failed} failed in {total:.1f}s")
    return 1 if failed else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("golden", help="record or check goldens (golden/<case>.npz + .json)")
    gsub = g.add_subparsers(dest="golden_command", required=True)
    s = gsub.add_parser("record", help="(re)record goldens atomically and show what changed; never under pytest-xdist")
    s.add_argument("cases", nargs="*", help="case names or paths")
    s.add_argument("--all", action="store_true", help="every case in cases/")
    s.add_argument("--golden-dir", help="where goldens live (default: golden/)")
    add_cases_dir(s)
    s.set_defaults(func=cmd_golden_record)
    s = gsub.add_parser("check", help="compare fresh runs with the goldens: %% differing, max abs/rel error, first indices, by rank and step")
    s.add_argument("cases", nargs="*", help="case names or paths (default: every case in cases/)")
    s.add_argument("--golden-dir", help="where goldens live (default: golden/)")
    s.add_argument("--limit", type=int, default=12, help="differing keys shown per case (default 12)")
    s.add_argument("--mutant", help="plant a mutant first (what a regression looks like to the goldens)")
    s.add_argument("--json", action="store_true")
    add_cases_dir(s)
    s.set_defaults(func=cmd_golden_check)
