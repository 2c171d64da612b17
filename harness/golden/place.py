"""Where a case's goldens live, the command that (re)records them, and where no golden may be written.

A case's goldens sit beside its case file: the shipped cases' in the shipped golden folder, any
other case's in `golden/` inside its cases folder (`--cases-dir mycases` -> `mycases/golden/`, its
acceptance and draft-tree goldens in `mycases/golden/acceptance/`). The CLI, the pytest plugin and
the API all derive it here, so a golden recorded by one is the golden the others read.

Nothing is written inside the installed package (its cases and goldens are read-only data), nor
while a mutant is planted (a golden would record the mutant's bug as the truth). A source checkout's
own cases/ and golden/ are written only from inside the checkout: that is how the shipped goldens
are made; a project elsewhere that imports this checkout gets the same refusal as a wheel's user.
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional

from harness.cases.case import CASES_DIR, Case
from harness.cases.data import checkout_root, package_dir
from harness.golden.base import GOLDEN_DIR, GoldenError, show
from harness.mutants.base import planted_ids

USER_GOLDEN_SUBDIR = "golden"  # <cases-dir>/golden/: a user's goldens, beside their cases
ACCEPTANCE_SUBDIR = "acceptance"  # <golden-dir>/acceptance/: the loop's goldens (acceptance, draft trees)
# what a refusal tells a user to pass instead, on the command line and under pytest
CLI_FLAGS = "--cases-dir DIR (its goldens go to DIR/golden/) or --golden-dir DIR"
PYTEST_FLAGS = "--specharness-cases-dir DIR (its goldens go to DIR/golden/) or --specharness-golden-dir DIR"


class GoldenWriteRefused(GoldenError):
    """A record that would corrupt data: into the installed package, or with a mutant planted (exit 2)."""


def _same(a: Path | str, b: Path | str) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def golden_dir_for(cases_dir: Path | str) -> Path:
    """The goldens of the cases in `cases_dir`: the shipped goldens for the shipped cases, else cases_dir/golden."""
    return GOLDEN_DIR if _same(cases_dir, CASES_DIR) else Path(cases_dir) / USER_GOLDEN_SUBDIR


def cases_dir_of(case: Case) -> Path:
    return Path(case.path).parent


def case_golden_dir(case: Case) -> Path:
    """Where the case's array goldens are unless a golden dir is given (golden_dir_for its case file's folder)."""
    return golden_dir_for(cases_dir_of(case))


def accept_dir_of(case: Case, golden_dir: Optional[Path] = None) -> Path:
    """Where the case's acceptance and draft-tree goldens are: golden_dir (default: the case's) / acceptance."""
    return Path(golden_dir or case_golden_dir(case)) / ACCEPTANCE_SUBDIR


def record_command(case: Case, golden_dir: Optional[Path] = None, kind: Optional[str] = None) -> str:
    """The `harness golden record` line that records this case's golden where it was looked for."""
    parts = ["harness", "golden", "record", case.name]
    if kind is not None:
        parts += ["--kind", str(kind)]
    cd = cases_dir_of(case)
    if not _same(cd, CASES_DIR):
        parts += ["--cases-dir", show(cd)]
    if golden_dir is not None and not _same(golden_dir, golden_dir_for(cd)):
        parts += ["--golden-dir", show(golden_dir)]
    return shlex.join(parts)


def check_writable(directory: Path | str, flags: str = CLI_FLAGS) -> None:
    """Refuse (GoldenWriteRefused) to write goldens or cases into `directory`: while a mutant is planted, inside
    the installed package, or into a checkout's shipped folders from outside that checkout. `flags`: what to pass instead."""
    planted = planted_ids()
    if planted:
        raise GoldenWriteRefused(f"refusing to record while mutant {', '.join(planted)} is planted: the golden would hold the "
                                 "mutant's bug as the expected result; record without --mutant (pytest: without --specharness-mutant)")
    d = Path(directory).resolve()
    if _within(d, package_dir()):
        raise GoldenWriteRefused(f"refusing to write into {d}: it is inside the installed specharness package, whose shipped cases "
                                 f"and goldens are read-only data; keep your cases and goldens in a directory of your own: {flags}")
    root = checkout_root()
    if root is not None and any(_within(d, root / sub) for sub in ("cases", "golden")) and not _within(Path.cwd().resolve(), root):
        raise GoldenWriteRefused(f"refusing to write into {d}: the shipped cases and goldens of the specharness checkout {root} are "
                                 f"re-recorded from inside it (cd {shlex.quote(str(root))}); for your own cases: {flags}")
