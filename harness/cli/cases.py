"""The cases a command runs: named ones, or every case in --cases-dir (default: the shipped ones)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from harness.case import CASES_DIR, default_cases, load_case
from harness.errors import UsageError


def cases_dir(args) -> Path:
    return Path(getattr(args, "cases_dir", None) or CASES_DIR)


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
    s.add_argument("--cases-dir", metavar="DIR", help=f"where case names are looked up and what runs by default (default: {CASES_DIR})")
