"""Plant each mutant in-process, run every probe, report who killed it.

Killed means a property reported a failure. A collective timeout is not a kill (a hang
caught by a deadline says nothing about which property sees the bug), and neither is a
probe that raised: that is reported as an error so it can't pass for a kill.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from harness.mutants import CATALOG, Mutant
from harness.suite import PROBES
from harness.verdict import Verdict, merge_verdicts

PROPERTY_ORDER = ("P1", "P2", "P3", "P4", "P5", "P6", "P7", "P8", "run")  # "run": a rank crashed or desynced


@dataclass
class MutantResult:
    id: str
    description: str
    killed: bool
    killed_by: Optional[str]
    seconds: float
    failed_properties: list[str] = field(default_factory=list)
    first_failure: str = ""
    timeouts: int = 0

    def to_json(self) -> dict:
        return {
            "id": self.id, "description": self.description, "killed": self.killed, "killed_by": self.killed_by,
            "seconds": round(self.seconds, 2), "failed_properties": self.failed_properties, "first_failure": self.first_failure,
        }


def _is_timeout(v: Verdict) -> bool:
    return bool(v.failures) and all(f.check == "run" and f.got == "CollectiveTimeout" for f in v.failures)


def run_probes() -> dict[str, Verdict]:
    merged: dict[str, Verdict] = {}
    for _name, probe in PROBES:
        merge_verdicts(merged, probe())
    return merged


def run_mutant(m: Mutant) -> MutantResult:
    t0 = time.perf_counter()
    with m.planted():
        verdicts = run_probes()
    failed = [p for p in PROPERTY_ORDER if p in verdicts and not verdicts[p].ok and not _is_timeout(verdicts[p])]
    timeouts = sum(1 for v in verdicts.values() if _is_timeout(v))
    first = verdicts[failed[0]].first() if failed else ""
    return MutantResult(m.id, m.description, bool(failed), failed[0] if failed else None, time.perf_counter() - t0, failed, first, timeouts)


def run_catalog(only: Optional[list[str]] = None, on_result: Optional[Callable[[MutantResult], None]] = None) -> list[MutantResult]:
    chosen = [m for m in CATALOG if only is None or m.id in only]
    unknown = set(only or ()) - {m.id for m in CATALOG}
    if unknown:
        raise KeyError(f"unknown mutant(s): {', '.join(sorted(unknown))}; known: {', '.join(m.id for m in CATALOG)}")
    results = []
    for m in chosen:
        r = run_mutant(m)
        results.append(r)
        if on_result:
            on_result(r)
    return results
