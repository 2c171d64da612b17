"""Every golden a case's checks read, recorded in one go or named as missing.

arrays: the golden item of the pytest plugin and `harness golden check`; acceptance: P6 (`harness check --props
all`), for every case the speculative decoding loop can run; draft-tree: P6 of a single-layer draft's case. A case
added with `harness new-case --record` or `harness golden record CASE` gets all of them, so every check of it
has its golden.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from harness.cases.case import Case
from harness.golden.acceptance import AcceptanceGoldenError, golden_path, needs_acceptance, record_acceptance_golden
from harness.golden.base import GoldenError, GoldenKind, show
from harness.golden.draft_tree import needs_draft_tree, record_tree_golden, tree_golden_path
from harness.golden.lifecycle import record_golden
from harness.golden.logprobs import logprob_golden_path, needs_logprobs, record_logprob_golden
from harness.golden.place import GoldenWriteRefused, accept_dir_of, case_golden_dir, record_command
from harness.golden.store import GoldenPaths
from harness.run.loop import spec_skip_reason


def needed_kinds(case: Case) -> tuple[GoldenKind, ...]:
    """The golden kinds some check of this case reads."""
    return (GoldenKind.ARRAYS, *((GoldenKind.ACCEPTANCE,) if needs_acceptance(case) else ()),
            *((GoldenKind.DRAFT_TREE,) if needs_draft_tree(case) else ()), *((GoldenKind.LOGPROBS,) if needs_logprobs(case) else ()))


def kind_paths(case: Case, kind: GoldenKind, golden_dir: Optional[Path] = None) -> list[Path]:
    """The files that hold the case's golden of this kind (golden_dir default: beside the case)."""
    d = Path(golden_dir) if golden_dir is not None else case_golden_dir(case)
    if kind is GoldenKind.ARRAYS:
        p = GoldenPaths.of(d, case.name)
        return [p.npz, p.json]
    if kind is GoldenKind.ACCEPTANCE:
        return [golden_path(case.name, accept_dir_of(case, d))]
    if kind is GoldenKind.LOGPROBS:
        return [logprob_golden_path(case.name, accept_dir_of(case, d))]
    return [tree_golden_path(case.name, accept_dir_of(case, d))]


def missing_kinds(case: Case, golden_dir: Optional[Path] = None) -> list[GoldenKind]:
    """The needed kinds with a file missing (what a check of the case would fail on as 'no golden')."""
    return [k for k in needed_kinds(case) if not all(p.exists() for p in kind_paths(case, k, golden_dir))]


@dataclass
class KindOutcome:
    kind: GoldenKind
    recorded: bool  # False: still missing (why in text)
    changed: bool
    text: str


def record_case_goldens(case: Case, golden_dir: Optional[Path] = None, kinds: Optional[Sequence[GoldenKind]] = None,
                        say: Callable[[str], None] = print) -> list[KindOutcome]:
    """Record each of `kinds` (default: every needed kind) of the case; a kind that can't be recorded (its eager
    and graph runs disagree) is reported as missing with the reason and the command, and the others still recorded.
    A refused write (a mutant planted, the installed package) raises before anything runs."""
    needed = needed_kinds(case)
    extra = [str(k) for k in kinds or () if k not in needed]
    if extra:  # nothing could record it, and nothing would read it
        raise GoldenError(f"{case.name}: no check reads a {' or '.join(extra)} golden of this case ({spec_skip_reason(case) or 'not a single-layer draft'}); "
                          f"its goldens: {', '.join(map(str, needed))}")
    out: list[KindOutcome] = []
    for kind in kinds if kinds is not None else needed:
        try:
            if kind is GoldenKind.ARRAYS:
                res = record_golden(case, golden_dir)
                out.append(KindOutcome(kind, True, res.status != "unchanged", res.format()))
            else:
                (path,) = kind_paths(case, kind, golden_dir)
                before = path.read_bytes() if path.exists() else None
                lines: list[str] = []
                accept_dir = accept_dir_of(case, golden_dir) if golden_dir is not None else None
                if kind is GoldenKind.ACCEPTANCE:
                    record_acceptance_golden(case, accept_dir, say=lines.append)
                elif kind is GoldenKind.LOGPROBS:
                    lines.append(f"{case.name}: logprobs -> {show(record_logprob_golden(case, accept_dir))}")
                else:
                    lines.append(f"{case.name}: draft trees -> {show(record_tree_golden(case, accept_dir))}")
                out.append(KindOutcome(kind, True, path.read_bytes() != before, "\n".join(lines)))
        except GoldenWriteRefused:
            raise
        except AcceptanceGoldenError as e:
            out.append(KindOutcome(kind, False, False, f"{case.name}: {kind} golden not recorded: {e}; once fixed: "
                                                       f"{record_command(case, golden_dir, kind)}"))
        say(out[-1].text)
    return out
