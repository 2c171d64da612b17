"""Which cases `harness check` runs, as pytest selects tests: `-k EXPRESSION` over case names, and `--lf`, the cases
that failed last time (kept in .specharness_cache/ of the working directory, as pytest keeps .pytest_cache/).

-k takes pytest's grammar: words matched as case-insensitive substrings of the case name, combined with `and`,
`or`, `not` and parentheses (`-k "tp4 and not dp"`).
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Callable, Iterable, Sequence

from harness.cases.case import Case
from harness.errors import UsageError

CACHE_DIR = Path(".specharness_cache")
LASTFAILED = "lastfailed"
_TOKEN = re.compile(r"\s*(\(|\)|[^\s()]+)")


def _tokens(expr: str) -> list[str]:
    pos, out = 0, []
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            break
        out.append(m.group(1))
        pos = m.end()
    return out


def keyword_matcher(expr: str) -> Callable[[str], bool]:
    """-k EXPR as a predicate on a case name; a malformed expression is a UsageError naming where it broke."""
    toks = _tokens(expr)
    pos = 0

    def bad(what: str) -> UsageError:
        at = " ".join(toks[:pos]) + " >>> " + " ".join(toks[pos:])
        return UsageError(f"-k {expr!r}: {what} at: {at.strip()} (words, and/or/not, parentheses, as pytest -k)")

    def peek() -> str:
        return toks[pos] if pos < len(toks) else ""

    def take() -> str:
        nonlocal pos
        pos += 1
        return toks[pos - 1]

    def or_() -> Callable[[str], bool]:
        left = and_()
        while peek() == "or":
            take()
            right = and_()
            left = (lambda a, b: lambda n: a(n) or b(n))(left, right)
        return left

    def and_() -> Callable[[str], bool]:
        left = not_()
        while peek() == "and":
            take()
            right = not_()
            left = (lambda a, b: lambda n: a(n) and b(n))(left, right)
        return left

    def not_() -> Callable[[str], bool]:
        if peek() == "not":
            take()
            inner = not_()
            return lambda n: not inner(n)
        return atom()

    def atom() -> Callable[[str], bool]:
        tok = peek()
        if tok == "(":
            take()
            inner = or_()
            if peek() != ")":
                raise bad("expected ')'")
            take()
            return inner
        if tok in ("", ")", "and", "or"):
            raise bad("expected a word, 'not' or '('")
        word = take().lower()
        return lambda n: word in n.lower()

    if not toks:
        raise UsageError("-k: empty expression (a word of the case names, as pytest -k)")
    match = or_()
    if pos != len(toks):
        raise bad("expected 'and', 'or' or the end")
    return match


def _cache_file() -> Path:
    return CACHE_DIR / LASTFAILED


def last_failed() -> set[str]:
    """The case files (resolved paths) that failed when they last ran."""
    try:
        data = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return set()
    return {p for p in data if isinstance(p, str)} if isinstance(data, list) else set()


def update_last_failed(ran: Iterable[tuple[Case, bool]]) -> None:
    """Record which of the cases that ran failed (the others keep their entry); a cache that can't be written is
    said on stderr, never fatal."""
    failed = last_failed()
    for case, ok in ran:
        key = str(Path(case.path).resolve())
        (failed.discard if ok else failed.add)(key)
    try:
        CACHE_DIR.mkdir(exist_ok=True)
        (CACHE_DIR / ".gitignore").write_text("# written by harness check (--lf)\n*\n")
        tmp = CACHE_DIR / f".{LASTFAILED}.{os.getpid()}.tmp"  # replaced whole: a concurrent check reads the old set or the new
        tmp.write_text(json.dumps(sorted(failed), indent=1) + "\n")
        os.replace(tmp, _cache_file())
    except OSError as e:
        print(f"harness check: could not write {_cache_file()} ({e.strerror or e}); --lf will not know this run", file=sys.stderr)


def select(cases: Sequence[Case], keyword: str | None, lf: bool) -> tuple[list[Case], str]:
    """The cases -k and --lf keep, and a line saying what was deselected ('' when nothing was)."""
    out, notes = list(cases), []
    if lf:
        failed = last_failed()
        kept = [c for c in out if str(Path(c.path).resolve()) in failed]
        if kept:
            notes.append(f"--lf: {len(kept)} case(s) that failed last")
            out = kept
        else:
            notes.append("--lf: no case failed last time; running all")
    if keyword:
        match = keyword_matcher(keyword)
        kept = [c for c in out if match(c.name)]
        notes.append(f"-k {keyword!r}: {len(kept)} of {len(out)} case(s)")
        out = kept
    if not out:
        raise UsageError(f"no case selected ({'; '.join(notes)})")
    return out, "; ".join(notes)
