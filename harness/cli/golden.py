"""`harness golden record|check [--kind arrays|acceptance|draft-tree]`: every kind of golden, one command.

arrays (the default): golden/<case>.npz + .json, a graph run's metadata and outputs.
acceptance: golden/acceptance/<case>.json, the loop's accept lengths (P6).
draft-tree: golden/acceptance/<case>.draft_tree.json, the single-layer draft decode's trees (P6).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from harness.case import Case, load_case
from harness.cli.cases import add_cases_dir, cases_dir, golden_dir, named_cases
from harness.cli.options import enum_option
from harness.cli.ranks import mutant_ctx
from harness.errors import UsageError
from harness.golden.acceptance import GOLDEN_CASES, record_acceptance
from harness.golden.base import GoldenError, GoldenFormatError, GoldenKind
from harness.golden.draft_tree import TREE_CASES, check_tree_case, record_tree_goldens
from harness.golden.lifecycle import check_golden, iter_cases, record_golden, refuse_under_xdist
from harness.props.p6 import check_acceptance_case
from harness.verdict import Verdict

LOOP_KINDS: dict[GoldenKind, tuple[tuple[str, ...], Callable[[Case], Verdict]]] = {
    GoldenKind.ACCEPTANCE: (GOLDEN_CASES, check_acceptance_case),
    GoldenKind.DRAFT_TREE: (TREE_CASES, check_tree_case),
}
KIND_OPTION = enum_option(GoldenKind)


def _accept_dir(args) -> Optional[Path]:
    return Path(args.golden_dir) / "acceptance" if args.golden_dir else None


def cmd_golden_record(args) -> int:
    refuse_under_xdist(golden_dir(args))
    kind = args.kind
    if kind is not GoldenKind.ARRAYS:
        if args.cases and args.all:
            raise GoldenError("name cases or pass --all, not both")
        if not args.cases and not args.all:
            raise GoldenError(f"name a case (e.g. harness golden record --kind {kind} {LOOP_KINDS[kind][0][0]}) or pass --all")
        names = args.cases or LOOP_KINDS[kind][0]
        if kind is GoldenKind.ACCEPTANCE:
            record_acceptance(names, accept_dir=_accept_dir(args))
        else:
            record_tree_goldens(names, accept_dir=_accept_dir(args))
        return 0
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
    kind = args.kind
    if kind is not GoldenKind.ARRAYS and args.golden_dir:
        raise UsageError(f"--golden-dir: checks of --kind {kind} read the shipped goldens only (golden/acceptance/)")
    if kind is GoldenKind.ARRAYS:
        cases = named_cases(args.cases, args)
    else:
        cases = [load_case(n, cases_dir(args)) for n in (args.cases or LOOP_KINDS[kind][0])]
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


def _add_kind(s: argparse.ArgumentParser) -> None:
    s.add_argument("--kind", type=KIND_OPTION, metavar=KIND_OPTION.choices_text, default=GoldenKind.ARRAYS,
                   help="arrays: golden/<case>.npz + .json (default); acceptance: the loop's accept lengths; "
                        "draft-tree: the single-layer draft decode's trees (both golden/acceptance/)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("golden", help="record or check goldens: arrays (golden/<case>.npz + .json), acceptance, draft trees")
    gsub = g.add_subparsers(dest="golden_command", required=True)
    s = gsub.add_parser("record", help="(re)record goldens atomically and show what changed; never under pytest-xdist")
    s.add_argument("cases", nargs="*", help="case names or paths")
    s.add_argument("--all", action="store_true", help="every case of the kind (arrays: every case in cases/)")
    s.add_argument("--golden-dir", help="where goldens live (default: golden/; the loop kinds write to its acceptance/)")
    _add_kind(s)
    add_cases_dir(s)
    s.set_defaults(func=cmd_golden_record)
    s = gsub.add_parser("check", help="compare fresh runs with the goldens: %% differing, max abs/rel error, first indices, by rank and step")
    s.add_argument("cases", nargs="*", help="case names or paths (default: every case of the kind)")
    s.add_argument("--golden-dir", help="where array goldens live (default: golden/)")
    s.add_argument("--limit", type=int, default=12, help="differing keys shown per case (default 12)")
    s.add_argument("--mutant", help="plant a mutant first (what a regression looks like to the goldens)")
    s.add_argument("--json", action="store_true")
    _add_kind(s)
    add_cases_dir(s)
    s.set_defaults(func=cmd_golden_check)
