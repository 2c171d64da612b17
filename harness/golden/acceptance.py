"""Acceptance goldens (P6): <golden-dir>/acceptance/<case>.json (the shipped ones in golden/acceptance/), per request
the accept length of every verify round and the per-position accept counts of the case's workload through the loop.

Exact integers, so there is nothing to tolerate; a golden recorded for another model fingerprint,
alignment, workload, spec or layout is refused with the fields named, never compared. Recorded from
the eager runner and refused when the graph runner accepts differently.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional, Sequence

from harness.cases.case import Case, default_cases, load_case
from harness.golden.base import GOLDEN_DIR, GoldenError, GoldenKind, show
from harness.golden.lifecycle import refuse_under_xdist
from harness.golden.place import accept_dir_of, check_writable, record_command
from harness.golden.store import write_text_atomic
from harness.run.loop import Workload, acceptance_stats, case_session, spec_skip_reason
from runners.spec_decode import DEFAULT_ALIGNMENT, Alignment

ACCEPT_DIR = GOLDEN_DIR / "acceptance"  # the shipped ones
FORMAT = "specharness-acceptance/1"


def needs_acceptance(case: Case) -> bool:
    """P6 reads an acceptance golden of every case the loop can run."""
    return spec_skip_reason(case) is None


# every shipped case the loop can run has an acceptance golden
GOLDEN_CASES = tuple(c.name for c in default_cases() if needs_acceptance(c))


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
                 **({"draft": spec.draft} if spec.draft != "multi_layer" else {}), **spec.draft_fields(),
                 **{flag: True for flag in ("dp_spec_prefill_coordination", "overlap_schedule") if getattr(spec, flag)}},
        "layout": sc.layout.describe(),
    }


def golden_path(name: str, accept_dir: Optional[Path] = None) -> Path:
    """<accept_dir>/<name>.json (default: the shipped acceptance goldens)."""
    return (accept_dir or ACCEPT_DIR) / f"{name}.json"


def _record_cmd(case: Case, accept_dir: Optional[Path]) -> str:
    return record_command(case, None if accept_dir is None else Path(accept_dir).parent, GoldenKind.ACCEPTANCE)


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
    """The case's golden (in accept_dir; default: beside the case, harness.golden.place), or AcceptanceGoldenError
    naming what is missing or differs."""
    path = golden_path(case.name, accept_dir or accept_dir_of(case))
    if not path.exists():
        raise AcceptanceGoldenError(f"{show(path)}: no acceptance golden for case {case.name!r}; "
                                    f"record it: {_record_cmd(case, accept_dir)}")
    data = read_golden_json(path, FORMAT)
    want = golden_identity(case, wl or Workload.from_case(case))
    diff = [k for k in want if data.get(k) != want[k]]
    if diff:
        detail = "; ".join(f"{k}: golden {data.get(k)!r}, case {want[k]!r}" for k in diff)
        raise AcceptanceGoldenError(f"{path}: refused, recorded for another model or setup ({detail}); "
                                    f"re-record it: {_record_cmd(case, accept_dir)}")
    return data


def record_acceptance_golden(case: Case, accept_dir: Optional[Path] = None, say: Callable[[str], None] = print) -> Path:
    """Record from the eager runner into accept_dir (default: beside the case); refuse if the graph runner's
    acceptance differs (it must not). A golden whose contents did not change is not rewritten."""
    accept_dir = Path(accept_dir) if accept_dir is not None else accept_dir_of(case)
    check_writable(accept_dir)
    refuse_under_xdist(accept_dir)
    wl = Workload.from_case(case)
    eager = acceptance_stats(case_session(case, "eager"))
    graph = acceptance_stats(case_session(case, "graph"))
    if eager["requests"] != graph["requests"]:
        raise AcceptanceGoldenError(f"{case.name}: eager and graph runners accept differently; not recording "
                                    f"(`harness check {case.name} --props P6` shows where)")
    data = {"format": FORMAT, "case": case.name, **golden_identity(case, wl), **eager}
    path = golden_path(case.name, accept_dir)
    text = json.dumps(data, indent=1, sort_keys=False) + "\n"
    s = eager["summary"]
    if path.exists() and path.read_text() == text:
        say(f"{case.name}: acceptance unchanged, {show(path)} not rewritten")
    else:
        write_text_atomic(path, text)
        say(f"{case.name}: acceptance, {s['verify_rounds']} verify rounds, mean accept length {s['mean_accept_len']}, per position "
            f"{s['position_accept_rate']} -> {show(path)}")
    return path


def record_acceptance(names: Sequence[str] = GOLDEN_CASES, say: Callable[[str], None] = print, accept_dir: Optional[Path] = None,
                      cases_dir: Optional[Path] = None) -> list[Path]:
    """record_acceptance_golden for each named case (looked up in cases_dir, default the shipped cases)."""
    cases = [load_case(name, cases_dir) for name in names]
    if cases:  # refused before any case runs
        check_writable(accept_dir if accept_dir is not None else accept_dir_of(cases[0]))
    return [record_acceptance_golden(case, accept_dir, say) for case in cases]
