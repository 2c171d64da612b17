"""Acceptance goldens (P6): golden/acceptance/<case>.json, per request the accept length of every verify round
and the per-position accept counts of the case's workload through the loop.

Exact integers, so there is nothing to tolerate; a golden recorded for another model fingerprint,
alignment, workload, spec or layout is refused with the fields named, never compared. Recorded from
the eager runner and refused when the graph runner accepts differently.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional, Sequence

from harness.case import Case, default_cases, load_case
from harness.golden.base import GOLDEN_DIR, GoldenError
from harness.golden.lifecycle import refuse_under_xdist
from harness.golden.store import write_text_atomic
from harness.run.loop import Workload, acceptance_stats, case_session, spec_skip_reason
from runners.spec_decode import DEFAULT_ALIGNMENT, Alignment

ACCEPT_DIR = GOLDEN_DIR / "acceptance"
FORMAT = "specharness-acceptance/1"

# every shipped case the loop can run has an acceptance golden
GOLDEN_CASES = tuple(c.name for c in default_cases() if spec_skip_reason(c) is None)


class AcceptanceGoldenError(GoldenError):
    """Missing, refused or malformed acceptance golden: a message, never a traceback."""


def golden_identity(case: Case, wl: Workload, alignment: Alignment = DEFAULT_ALIGNMENT) -> dict:
    """What the golden was made from; any difference refuses it."""
    sc = case.scenario
    spec = sc.spec
    return {
        "fingerprint": sc.model.fingerprint(),
        "alignment": alignment.to_json(),
        "workload": wl.to_json(),
        "spec": {"num_steps": spec.num_steps, "topk": spec.topk, "num_tokens_per_bs": spec.num_tokens_per_bs, "capture_bs": list(spec.capture_bs),
                 "max_running_requests": spec.max_running_requests, "page_size": spec.page_size,
                 **({"draft": spec.draft} if spec.draft != "multi_layer" else {})},
        "layout": sc.layout.describe(),
    }


def golden_path(name: str, accept_dir: Optional[Path] = None) -> Path:
    return (accept_dir or ACCEPT_DIR) / f"{name}.json"


def read_golden_json(path: Path, fmt: str) -> dict:
    """A loop golden's JSON object, or AcceptanceGoldenError naming the file and what is wrong (acceptance and draft-tree goldens alike)."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AcceptanceGoldenError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != fmt:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise AcceptanceGoldenError(f"{path}: format {got!r}, expected {fmt!r}")
    return data


def load_acceptance_golden(case: Case, wl: Optional[Workload] = None, accept_dir: Optional[Path] = None) -> dict:
    """The case's golden, or AcceptanceGoldenError naming what is missing or differs."""
    path = golden_path(case.name, accept_dir)
    if not path.exists():
        raise AcceptanceGoldenError(f"{path}: no acceptance golden for case {case.name!r}; "
                                    f"record it: harness golden record --kind acceptance {case.name}")
    data = read_golden_json(path, FORMAT)
    want = golden_identity(case, wl or Workload.from_case(case))
    diff = [k for k in want if data.get(k) != want[k]]
    if diff:
        detail = "; ".join(f"{k}: golden {data.get(k)!r}, case {want[k]!r}" for k in diff)
        raise AcceptanceGoldenError(f"{path}: refused, recorded for another model or setup ({detail}); "
                                    f"re-record it: harness golden record --kind acceptance {case.name}")
    return data


def record_acceptance(names: Sequence[str] = GOLDEN_CASES, say: Callable[[str], None] = print, accept_dir: Optional[Path] = None) -> list[Path]:
    """Record from the eager runner; refuse if the graph runner's acceptance differs (it must not).
    A golden whose contents did not change is not rewritten."""
    refuse_under_xdist(GOLDEN_DIR if accept_dir is None else accept_dir)
    paths = []
    for name in names:
        case = load_case(name)
        wl = Workload.from_case(case)
        eager = acceptance_stats(case_session(case, "eager"))
        graph = acceptance_stats(case_session(case, "graph"))
        if eager["requests"] != graph["requests"]:
            raise AcceptanceGoldenError(f"{name}: eager and graph runners accept differently; not recording (run the P6 check to see where)")
        data = {"format": FORMAT, "case": name, **golden_identity(case, wl), **eager}
        path = golden_path(name, accept_dir)
        text = json.dumps(data, indent=1, sort_keys=False) + "\n"
        s = eager["summary"]
        if path.exists() and path.read_text() == text:
            say(f"{name}: unchanged, {path} not rewritten")
        else:
            write_text_atomic(path, text)
            say(f"{name}: {s['verify_rounds']} verify rounds, mean accept length {s['mean_accept_len']}, per position {s['position_accept_rate']} -> {path}")
        paths.append(path)
    return paths
