"""`harness mutants`: plant each mutant of the catalog, run its probes, report which property killed it."""
from __future__ import annotations

import json
import sys
import time


def cmd_mutants(args) -> int:
    from harness.mutants import CATALOG, get  # the catalog and the probes load when the command runs (harness.cli)

    if args.jobs is not None and args.jobs < 1:
        raise SystemExit("harness mutants: --jobs must be >= 1")
    if args.list:
        if args.json:
            print(json.dumps([{"id": m.id, "kind": m.kind, "description": m.description} for m in CATALOG], indent=2))
        else:
            width = max(len(m.id) for m in CATALOG)
            for m in CATALOG:
                print(f"{m.id:<{width}}  {m.description}  [{m.kind}]")
        return 0
    for mutant_id in args.only or ():
        get(mutant_id)  # an unknown id: the closest ones named, before anything runs
    from harness.pipeline.mutants import run_catalog

    def line(r) -> str:
        if r.status == "error":
            return f"{r.id:<34} ERROR          {r.seconds:6.1f}s  {r.error}"
        status = f"killed by {r.killed_by}" if r.killed else "SURVIVED"
        text = f"{r.id:<34} {status:<14} {r.seconds:6.1f}s ({r.cpu_seconds:.1f}s cpu)  also: {','.join(r.failed_properties[1:]) or '-'}"
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
        doc = {"seconds": round(total, 2), "all_properties": args.all_properties, "all_probes": args.all_probes,
               "mutants": [r.to_json() for r in results]}
        print(json.dumps(doc, indent=2))
    else:
        for r in results:
            print(line(r), flush=True)
        errors = sum(r.status == "error" for r in results)
        scope = ("every registered probe" if args.all_probes else "each mutant's probes") + (
            ", all of them" if args.all_properties else ", stopped at its first kill (--all-properties: the full matrix)")
        cpu = sum(r.cpu_seconds for r in results)
        print(f"{len(results) - len(bad)} killed, {len(bad) - errors} survived, {errors} errors, {len(results)} mutants in {total:.1f}s "
              f"({cpu:.1f}s cpu in their probes); {scope}")
    if not results:
        print("no mutant ran", file=sys.stderr)
        return 1
    return 1 if bad else 0


def add_parser(subparsers) -> None:
    s = subparsers.add_parser("mutants", help="plant each mutant, run the fast properties, report kills")
    s.add_argument("--list", action="store_true", help="list the catalog's ids, kinds and descriptions; run nothing")
    s.add_argument("--only", action="append", metavar="ID", help="run only this mutant (repeatable)")
    s.add_argument("--jobs", "-j", type=int, default=None, metavar="N", help="mutants at once, each in its own process (default: os.cpu_count())")
    s.add_argument("--all-properties", action="store_true",
                   help="run every probe listed for each mutant (the full kill matrix); default: stop at the first probe that kills it")
    s.add_argument("--all-probes", action="store_true",
                   help="ignore each mutant's probe list and run every registered probe (to re-derive the lists after the runners change)")
    s.add_argument("--timeout", type=float, default=300.0, metavar="S", help="seconds per mutant before it is stopped and reported as an error")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_mutants)
