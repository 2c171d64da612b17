"""`harness golden record|check [--kind arrays|acceptance|draft-tree|logprobs]`: every kind of golden, one command.

arrays: <golden-dir>/<case>.npz + .json, a graph run's metadata and outputs.
acceptance: <golden-dir>/acceptance/<case>.json, the loop's accept lengths (P6).
draft-tree: <golden-dir>/acceptance/<case>.draft_tree.json, the draft decode's trees (P6).
logprobs: <golden-dir>/acceptance/<case>.logprobs.json, the logprobs the loop's requests asked for (P6).
The golden dir is the shipped goldens for the shipped cases, else <cases-dir>/golden/ (harness.golden.place).
`record` records every kind a case's checks read unless --kind names one; `check` compares arrays unless --kind
names another.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable

from harness.cases.case import Case, default_cases, load_case
from harness.cli.cases import add_cases_dir, add_golden_dir, cases_dir, golden_dir, named_cases
from harness.cli.options import enum_option
from harness.cli.ranks import mutant_ctx
from harness.errors import ExitCode, UsageError
from harness.golden.acceptance import GOLDEN_CASES, needs_acceptance
from harness.golden.base import GoldenError, GoldenFormatError, GoldenKind
from harness.golden.case_goldens import needed_kinds, record_case_goldens
from harness.golden.draft_tree import TREE_CASES, check_tree_case, needs_draft_tree
from harness.golden.lifecycle import check_golden, iter_cases, refuse_under_xdist
from harness.golden.logprobs import LOGPROB_CASES, check_logprob_case, needs_logprobs
from harness.golden.place import case_golden_dir, check_writable
from harness.props.p6 import check_acceptance_case
from harness.verdict import Verdict

LOOP_KINDS: dict[GoldenKind, tuple[tuple[str, ...], Callable[[Case], Verdict], Callable[[Case], bool]]] = {
    GoldenKind.ACCEPTANCE: (GOLDEN_CASES, check_acceptance_case, needs_acceptance),
    GoldenKind.DRAFT_TREE: (TREE_CASES, check_tree_case, needs_draft_tree),
    GoldenKind.LOGPROBS: (LOGPROB_CASES, check_logprob_case, needs_logprobs),
}
KIND_OPTION = enum_option(GoldenKind)


def _record_cases(args) -> list[Case]:
    kind = args.kind
    if kind is None or kind is GoldenKind.ARRAYS:
        return iter_cases(args.cases, args.all, cases_dir(args))
    if args.cases and args.all:
        raise GoldenError("name cases or pass --all, not both")
    if not args.cases and not args.all:
        raise GoldenError(f"name a case (e.g. harness golden record --kind {kind} {LOOP_KINDS[kind][0][0]}) or pass --all")
    if args.cases:
        return [load_case(n, cases_dir(args)) for n in args.cases]
    return [c for c in default_cases(cases_dir(args)) if LOOP_KINDS[kind][2](c)]


def cmd_golden_record(args) -> int:
    cases = _record_cases(args)
    gdir = golden_dir(args)
    for d in {gdir or case_golden_dir(c) for c in cases}:  # refused before anything runs
        check_writable(d)
        refuse_under_xdist(d)
    t0 = time.perf_counter()
    written = unchanged = 0
    missing: list[str] = []
    for i, case in enumerate(cases, 1):
        kinds = needed_kinds(case) if args.kind is None else (args.kind,)
        print(f"[{i}/{len(cases)}] recording {case.name} ({case.layout.describe()}): {', '.join(map(str, kinds))}", file=sys.stderr, flush=True)
        for o in record_case_goldens(case, gdir, kinds):
            written += o.recorded and o.changed
            unchanged += o.recorded and not o.changed
            if not o.recorded:
                missing.append(f"{case.name} {o.kind}")
    tail = f"; still missing: {', '.join(missing)}" if missing else ""
    print(f"{len(cases)} case(s): {written} golden(s) written, {unchanged} unchanged in {time.perf_counter() - t0:.1f}s{tail}")
    return ExitCode.PROPERTY_FAILED if missing else ExitCode.OK


def _check_one(kind: GoldenKind, case: Case, args) -> tuple[bool, str, dict]:
    if kind is not GoldenKind.ARRAYS:
        v = LOOP_KINDS[kind][1](case)
        return v.ok, f"{case.name}: {v.report()}", {"case": case.name, "ok": v.ok, "verdict": v.to_json()}
    try:
        cmp = check_golden(case, golden_dir(args))
        return cmp.ok, cmp.format(limit=args.limit), cmp.to_json()
    except GoldenFormatError:
        raise  # a malformed golden is bad input (exit 2), not a difference
    except GoldenError as e:
        return False, f"{case.name}: {e}", {"case": case.name, "ok": False, "error": str(e)}


def cmd_golden_check(args) -> int:
    kind = args.kind or GoldenKind.ARRAYS
    if kind is not GoldenKind.ARRAYS and args.golden_dir:
        raise UsageError(f"--golden-dir: checks of --kind {kind} read the goldens beside each case (--cases-dir DIR: DIR/golden/acceptance/; "
                         "the shipped ones for the shipped cases)")
    if kind is GoldenKind.ARRAYS:
        cases = named_cases(args.cases, args)
    elif args.cases:
        cases = [load_case(n, cases_dir(args)) for n in args.cases]
    else:
        cases = [c for c in default_cases(cases_dir(args)) if LOOP_KINDS[kind][2](c)]
    t0 = time.perf_counter()
    results, failed = [], 0
    for i, case in enumerate(cases, 1):
        t = time.perf_counter()
        with mutant_ctx(args.mutant):
            ok, text, data = _check_one(kind, case, args)
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
        print(json.dumps({"ok": not failed, "kind": kind.value, "seconds": round(total, 2), "cases": results}, indent=2, default=str))
    else:
        print(f"{len(cases) - failed} passed, {failed} failed in {total:.1f}s")
    return 1 if failed else 0


def _add_kind(s: argparse.ArgumentParser, default: str) -> None:
    s.add_argument("--kind", type=KIND_OPTION, metavar=KIND_OPTION.choices_text, default=None,
                   help=f"arrays: <golden-dir>/<case>.npz + .json; acceptance: the loop's accept lengths; draft-tree: the draft decode's "
                        f"trees; logprobs: the loop's returned logprobs (all three in <golden-dir>/acceptance/); default: {default}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("golden", help="record or check goldens: arrays (<case>.npz + .json), acceptance, draft trees, logprobs")
    gsub = g.add_subparsers(dest="golden_command", required=True)
    s = gsub.add_parser("record", help="(re)record every golden a case's checks read, atomically, and show what changed; never under pytest-xdist")
    s.add_argument("cases", nargs="*", help="case names or paths")
    s.add_argument("--all", action="store_true", help="every case in --cases-dir (with --kind acceptance|draft-tree: every case of the kind)")
    add_golden_dir(s, "the goldens are written (the loop kinds to its acceptance/)")
    _add_kind(s, "every kind the case's checks read")
    add_cases_dir(s)
    s.set_defaults(func=cmd_golden_record)
    s = gsub.add_parser("check", help="compare fresh runs with the goldens: %% differing, max abs/rel error, first values, by rank and step")
    s.add_argument("cases", nargs="*", help="case names or paths (default: every case of the kind in --cases-dir)")
    add_golden_dir(s, "array goldens are read")
    s.add_argument("--limit", type=int, default=12, help="differing keys shown per case (default 12)")
    s.add_argument("--mutant", help="plant a mutant first (what a regression looks like to the goldens)")
    s.add_argument("--json", action="store_true")
    _add_kind(s, "arrays")
    add_cases_dir(s)
    s.set_defaults(func=cmd_golden_check)
