"""Logprob goldens (P6): <golden-dir>/acceptance/<case>.logprobs.json, per request of the case's workload that asked for
logprobs its committed tokens, their target logprobs and, if it asked, the top-k at each (runners.logprobs).

Tokens and top-k ids exact; logprobs within LOGPROB_FLOATS. Recorded from the eager run, refused when the graph run
differs; a golden made for another model, workload, spec or layout is refused with the fields named.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional, Sequence

from harness.cases.case import Case, default_cases, load_case
from harness.golden.acceptance import (
    ACCEPT_DIR,
    AcceptanceGoldenError,
    golden_identity,
    needs_acceptance,
    read_golden_json,
)
from harness.golden.base import GoldenKind
from harness.golden.lifecycle import refuse_under_xdist
from harness.golden.place import accept_dir_of, check_writable, record_command
from harness.golden.store import write_text_atomic
from harness.props.p6_acceptance import P6
from harness.props.tolerances import Tol
from harness.run.loop import SpecSession, Workload, case_session
from harness.verdict import Verdict


def needs_logprobs(case: Case) -> bool:
    """A case whose requests ask for logprobs, and that the loop can run, has a logprob golden."""
    return case.top_logprobs_num is not None and needs_acceptance(case)


LOGPROB_FORMAT = "specharness-logprobs/1"
LOGPROB_CASES = tuple(c.name for c in default_cases() if needs_logprobs(c))  # the shipped cases whose requests ask
LOGPROB_FLOATS = Tol(1e-5, 1e-5, "fp32 CPU re-run of the recorded workload (the graph run's padded GEMMs: the P3 bound); "
                                  "a logprob from another row or model is O(1) off")
FIELDS = ("tokens", "token_logprobs", "top_logprobs_idx", "top_logprobs_val")


def logprob_golden_path(name: str, accept_dir: Optional[Path] = None) -> Path:
    return (accept_dir or ACCEPT_DIR) / f"{name}.logprobs.json"


def logprob_arrays(session: SpecSession) -> dict[str, dict[str, list]]:
    """Per request that asked for logprobs (by rid): what it returned."""
    out = {}
    for rid, r in sorted(session.requests().items()):
        if r.return_logprob:
            out[str(rid)] = {"tokens": r.tokens[len(r.prompt):], "token_logprobs": list(r.output_token_logprobs),
                             "top_logprobs_idx": [list(x) for x in r.output_top_logprobs_idx],
                             "top_logprobs_val": [list(x) for x in r.output_top_logprobs_val]}
    return out


def _floats_close(a: list, b: list) -> bool:
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(_floats_close(x, y) for x, y in zip(a, b, strict=True))
    return abs(a - b) <= LOGPROB_FLOATS.atol + LOGPROB_FLOATS.rtol * abs(b)


def compare_logprobs(v: Verdict, label: str, want: dict, got: dict, check: str = "logprob golden") -> None:
    """Tokens and top-k ids exact, logprobs within LOGPROB_FLOATS (a golden against a run, or one run against another)."""
    v.expect_equal(check, "requests", {"case": label}, sorted(want, key=int), sorted(got, key=int),
                   "the requests that asked for logprobs")
    for rid in sorted(set(want) & set(got), key=int):
        for f in FIELDS:
            v.checked += 1
            a, b = want[rid][f], got[rid][f]
            exact = f in ("tokens", "top_logprobs_idx")
            if not (a == b if exact else _floats_close(b, a)):
                first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if (x != y if exact else not _floats_close(y, x))), min(len(a), len(b)))
                v.fail(check, f, {"case": label, "request": int(rid), "position": first},
                       a[first] if first < len(a) else "-", b[first] if first < len(b) else "-",
                       "exact" if exact else f"rtol={LOGPROB_FLOATS.rtol} atol={LOGPROB_FLOATS.atol}: {LOGPROB_FLOATS.reason}")


def record_logprob_golden(case: Case, accept_dir: Optional[Path] = None) -> Path:
    """From the eager run, into accept_dir (default: beside the case); refused when the graph run's logprobs differ
    (P3/P5 would say where)."""
    accept_dir = Path(accept_dir) if accept_dir is not None else accept_dir_of(case)
    check_writable(accept_dir)
    refuse_under_xdist(accept_dir)
    if case.top_logprobs_num is None:
        raise AcceptanceGoldenError(f"{case.name}: its requests ask for no logprobs (set schedule.top_logprobs_num)")
    sessions = {r: case_session(case, r) for r in ("eager", "graph")}
    data = {"format": LOGPROB_FORMAT, "case": case.name, **golden_identity(case, Workload.from_case(case)),
            "requests": logprob_arrays(sessions["eager"])}
    v = Verdict(P6)
    compare_logprobs(v, case.name, data["requests"], logprob_arrays(sessions["graph"]))
    if not v.ok:
        raise AcceptanceGoldenError(f"{case.name}: eager and graph logprobs differ; not recording ({v.first()})")
    path = logprob_golden_path(case.name, accept_dir)
    write_text_atomic(path, json.dumps(data, separators=(",", ":")) + "\n")
    return path


def record_logprob_goldens(names: Sequence[str] = LOGPROB_CASES, say: Callable[[str], None] = print,
                           accept_dir: Optional[Path] = None, cases_dir: Optional[Path] = None) -> list[Path]:
    """record_logprob_golden for each named case (looked up in cases_dir, default the shipped cases)."""
    paths = []
    for name in names:
        paths.append(record_logprob_golden(load_case(name, cases_dir), accept_dir))
        say(f"{name}: -> {paths[-1]}")
    return paths


def check_logprob_golden(v: Verdict, case: Case, sessions: dict[str, SpecSession], accept_dir: Optional[Path] = None) -> None:
    """Each session's logprobs against the case's golden (in accept_dir; default: beside the case), into v (a missing
    or foreign golden is a failure)."""
    path = logprob_golden_path(case.name, accept_dir or accept_dir_of(case))
    where = {"case": case.name}
    record = record_command(case, None if accept_dir is None else Path(accept_dir).parent, GoldenKind.LOGPROBS)
    if not path.exists():
        v.fail("logprob golden", "file", where, "a logprob golden", "none", f"record it: {record}")
        return
    try:
        data = read_golden_json(path, LOGPROB_FORMAT)
    except AcceptanceGoldenError as e:
        v.fail("logprob golden", "file", where, LOGPROB_FORMAT, "unreadable", f"{e}; re-record it")
        return
    want = golden_identity(case, Workload.from_case(case))
    diff = [k for k in want if data.get(k) != want[k]]
    if diff:
        v.fail("logprob golden", "identity", where, {k: want[k] for k in diff}, {k: data.get(k) for k in diff},
               f"recorded for another model or setup; re-record it: {record}")
        return
    for runner, s in sessions.items():
        compare_logprobs(v, f"{case.name} ({runner})", data["requests"], logprob_arrays(s))


def check_logprob_case(case: Case) -> Verdict:
    """The logprob golden alone, eager and graph (`harness golden check --kind logprobs`)."""
    v = Verdict(P6)
    check_logprob_golden(v, case, {r: case_session(case, r) for r in ("eager", "graph")})
    return v
