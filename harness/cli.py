"""`harness`: list cases, check them, replay one, run the mutant catalog."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import Optional, Sequence

from harness.case import CaseError, default_cases, load_case


def _cases(names: Sequence[str]):
    return [load_case(n) for n in names] if names else default_cases()


def _mutant_ctx(mutant_id: Optional[str]):
    if not mutant_id:
        return contextlib.nullcontext()
    from harness.mutants import get

    return get(mutant_id).planted()


def cmd_list(args) -> int:
    cases = _cases(args.cases)
    if args.json:
        print(json.dumps([{"case": c.name, "layout": c.layout.describe(), "branch": c.layout.branch.value, "world_size": c.layout.world_size,
                           "description": c.description, "path": c.path} for c in cases], indent=2))
        return 0
    width = max(len(c.name) for c in cases)
    for c in cases:
        print(f"{c.name:<{width}}  {c.layout.describe():<48} world={c.layout.world_size}  {c.description}")
    return 0


def cmd_check(args) -> int:
    from harness.checks import check_case

    cases = _cases(args.cases)
    reports = []
    t0 = time.perf_counter()
    with _mutant_ctx(args.mutant):
        for i, case in enumerate(cases, 1):
            rep = check_case(case)
            reports.append(rep)
            if not args.json:
                verdicts = " ".join(f"{k}:{'ok' if v.ok else 'FAIL'}" for k, v in rep.verdicts.items())
                line = f"[{i}/{len(cases)}] {'PASS' if rep.ok else 'FAIL'} {case.name:<28} {rep.layout:<48} {verdicts}  {rep.seconds:.1f}s"
                print(line, flush=True)
                if not rep.ok:
                    print(f"      {rep.first_failure()[1]}", flush=True)
    failed = [r for r in reports if not r.ok]
    total = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"ok": not failed, "seconds": round(total, 2), "cases": [r.to_json() for r in reports]}, indent=2, default=str))
    else:
        print(f"{len(reports) - len(failed)} passed, {len(failed)} failed in {total:.1f}s")
    return 1 if failed else 0


def cmd_replay(args) -> int:
    from harness.replay import format_table, replay_case

    case = load_case(args.case)
    with _mutant_ctx(args.mutant):
        progress = None if args.json else (lambda msg: print(f"... {msg}", file=sys.stderr, flush=True))
        rep = replay_case(case, step=args.step, rank=args.rank, progress=progress)
    if args.json:
        print(json.dumps(rep.to_json(), indent=2, default=str))
    else:
        print(format_table(rep))
    return 0 if rep.ok else 1


def cmd_mutants(args) -> int:
    from harness.mutant_run import run_catalog

    def show(r):
        if not args.json:
            status = f"killed by {r.killed_by}" if r.killed else "SURVIVED"
            print(f"{r.id:<34} {status:<14} {r.seconds:6.1f}s  also: {','.join(r.failed_properties[1:]) or '-'}", flush=True)
            if r.killed:
                print(f"    {r.first_failure[:240]}", flush=True)

    results = run_catalog(args.only or None, on_result=show)
    survivors = [r for r in results if not r.killed]
    if args.json:
        print(json.dumps({"mutants": [r.to_json() for r in results]}, indent=2))
    else:
        print(f"{len(results) - len(survivors)} killed, {len(survivors)} survived, {len(results)} mutants")
    if not results:
        print("no mutant ran", file=sys.stderr)
        return 1
    return 1 if survivors else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="harness", description="Correctness harness for tensor-parallel speculative decoding (EAGLE draft-extend CUDA graphs).")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("list", help="list cases with layout and branch")
    s.add_argument("cases", nargs="*", help="case names or paths (default: every case in cases/)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_list)

    s = sub.add_parser("check", help="run the properties over cases (the main job)")
    s.add_argument("cases", nargs="*", help="case names or paths (default: every case in cases/)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--mutant", help="plant a mutant from the catalog first (see `harness mutants`)")
    s.set_defaults(func=cmd_check)

    s = sub.add_parser("replay", help="rerun one case step by step and show the first divergence")
    s.add_argument("case", help="case name (in cases/) or path to a .toml")
    s.add_argument("--step", type=int, help="only this draft step")
    s.add_argument("--rank", type=int, help="only this rank")
    s.add_argument("--mutant", help="plant a mutant first, e.g. sglang-26416")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_replay)

    s = sub.add_parser("mutants", help="plant each mutant, run the fast properties, report kills")
    s.add_argument("--only", action="append", metavar="ID", help="run only this mutant (repeatable)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_mutants)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CaseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyError as e:  # unknown mutant id and the like: a user mistake, not a crash
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
