"""`python -m harness.acceptance record|check [CASE ...]`: the acceptance goldens (P6) of the shipped cases.

Record runs each case's workload eagerly and through the graphs and refuses when they
accept differently; check compares a fresh run with the golden and fails on a run that crashed.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from harness.case import load_case
from harness.props.p5_p6 import check_acceptance_case
from harness.spec_decode import GOLDEN_CASES, AcceptanceGoldenError, record


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("record", "check"):
        print("usage: python -m harness.acceptance record|check [CASE ...]", file=sys.stderr)
        return 2
    names = argv[1:] or list(GOLDEN_CASES)
    try:
        if argv[0] == "record":
            record(names)
            return 0
        bad = 0
        for name in names:
            v = check_acceptance_case(load_case(name))
            print(f"{name}: {v.report()}")
            bad += not v.ok
        return 1 if bad else 0
    except AcceptanceGoldenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

