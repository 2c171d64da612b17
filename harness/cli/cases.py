"""The case-file commands (`harness list`, `case-schema`; `new-case` in harness.cli.new_case) and the cases a command
runs: named ones, or every case in --cases-dir (default: the shipped ones), and where their goldens are."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional, Sequence

from harness.cases.case import CASES_DIR, default_cases, load_case
from harness.errors import UsageError
from harness.golden.place import USER_GOLDEN_SUBDIR


def cases_dir(args) -> Path:
    return Path(getattr(args, "cases_dir", None) or CASES_DIR)


def golden_dir(args) -> Optional[Path]:
    """--golden-dir as given; None: each case's goldens beside it (harness.golden.place.golden_dir_for)."""
    given = getattr(args, "golden_dir", None)
    return Path(given) if given else None


def named_cases(names: Sequence[str], args=None):
    """The named cases, else every case in --cases-dir (default: the shipped ones); none at all is an error."""
    d = cases_dir(args)
    if names:
        return [load_case(n, d) for n in names]
    cases = default_cases(d)
    if not cases:
        where = f"{d} (no such directory)" if not d.is_dir() else f"{d} (no *.toml in it)"
        raise UsageError(f"no cases: looked in {where}; name case files, or pass --cases-dir DIR")
    return cases


def add_cases_dir(s: argparse.ArgumentParser) -> None:
    s.add_argument("--cases-dir", metavar="DIR", help=f"where case names are looked up and what runs by default (default: the shipped "
                                                      f"cases, {CASES_DIR}); their goldens are in DIR/{USER_GOLDEN_SUBDIR}/")


def add_golden_dir(s: argparse.ArgumentParser, what: str) -> None:
    s.add_argument("--golden-dir", metavar="DIR", help=f"where {what} (default: beside the cases: --cases-dir DIR/{USER_GOLDEN_SUBDIR}/, "
                                                       "the shipped goldens for the shipped cases)")


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


def cmd_case_schema(args) -> int:
    from harness.cases.schema import case_json_schema

    print(json.dumps(case_json_schema(), indent=2))
    return 0


def add_parsers(subparsers) -> None:
    s = subparsers.add_parser("list", help="list cases with layout and branch")
    s.add_argument("cases", nargs="*", help="case names or paths (default: every case in cases/)")
    s.add_argument("--json", action="store_true")
    add_cases_dir(s)
    s.set_defaults(func=cmd_list)

    s = subparsers.add_parser("case-schema", help="print the JSON Schema of case files (for editors; the loader checks the rest)")
    s.set_defaults(func=cmd_case_schema)
