"""`harness engine-check --engine sglang --releases all|A,B,C|A..B`: install and check each release, one table.

Each release is checked in its own process (`python -m harness.engine_check --json`: the
adapter stubs imports and swaps module globals process-wide); installing it first is not
timed. The table has one row per release: version, API generation, verdict (PASS exit 0,
FAIL exit 1, ERROR exit 2: the adapter could not drive it), the first failure, and the
check's seconds (wall, and CPU of the check process). The exit status is the worst row's.
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from harness.engines.install import InstallError, ensure_installed, version_key

REPO = Path(__file__).resolve().parents[2]
# The oldest release whose wheel has the multi-layer draft-extend graph runner
# (sglang/srt/speculative/multi_layer_eagle_draft_extend_cuda_graph_runner.py): "all" starts here.
FIRST_RELEASE = "0.5.7"


@dataclass
class ReleaseRow:
    version: str
    api: str
    verdict: str  # PASS / FAIL / ERROR
    exit_code: int
    first_failure: str
    seconds: float  # wall time of the check, install excluded
    cpu_seconds: float  # CPU time of the check process (user + system)
    failures: int = 0
    notes: int = 0


def pypi_versions() -> list[str]:
    """Every sglang release the package index lists (pip's own client), oldest first."""
    proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "sglang", "--disable-pip-version-check"],
                          capture_output=True, text=True)
    for ln in proc.stdout.splitlines():
        if ln.startswith("Available versions:"):
            return sorted((v.strip() for v in ln.split(":", 1)[1].split(",") if v.strip()), key=version_key)
    raise InstallError(f"pip index versions sglang listed no versions (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")


def select(spec: str, available: Callable[[], list[str]] = pypi_versions) -> list[str]:
    """`all` (every release from FIRST_RELEASE), `A..B` (the listed releases between, inclusive) or `A,B,C` (as given)."""
    spec = spec.strip()
    if "," in spec or (spec != "all" and ".." not in spec):
        return [v.strip() for v in spec.split(",") if v.strip()]
    known = available()
    if spec == "all":
        lo, hi = FIRST_RELEASE, known[-1]
    else:
        lo, hi = (x.strip() for x in spec.split("..", 1))
        lo, hi = lo or FIRST_RELEASE, hi or known[-1]
    picked = [v for v in known if version_key(lo) <= version_key(v) <= version_key(hi)]
    if not picked:
        raise ValueError(f"--releases {spec}: no release between {lo} and {hi} among {known[-5:]}...")
    return picked


def check_release(version: str, extra: list[str], log: Callable[[str], None]) -> ReleaseRow:
    try:
        ensure_installed(version, log=log)
    except InstallError as e:
        return ReleaseRow(version, "-", "ERROR", 2, f"install: {e}", 0.0, 0.0)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "harness.engine_check", "--engine", f"sglang=={version}", "--json", *extra],
                          cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    verdict = {0: "PASS", 1: "FAIL"}.get(proc.returncode, "ERROR")
    api, first, nfail, nnotes = "-", "", 0, 0
    if proc.returncode in (0, 1):
        rep = json.loads(proc.stdout)
        api, nfail, nnotes = rep["api"], rep["summary"]["failures"], rep["summary"]["notes"]
        for ln in rep["lines"]:
            if ln["failures"]:
                f = ln["failures"][0]
                w = ", ".join(f"{k}={x}" for k, x in f["where"].items() if k in ("branch", "runner", "step", "path", "raw_bs", "bs"))
                first = f"{f['prop']}/{f['check']} {f['field']}: expected {f['expected']}, got {f['got']} [{w}]"
                break
    else:
        errs = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        first = errs[-1][len("error: "):] if errs else proc.stderr.strip().splitlines()[-1:] and proc.stderr.strip().splitlines()[-1]
    return ReleaseRow(version, api, verdict, proc.returncode, first, round(wall, 1), round(cpu, 1), nfail, nnotes)


def format_table(rows: list[ReleaseRow]) -> str:
    out = [f"{'version':<13} {'api':<8} {'verdict':<7} {'wall s':>6} {'cpu s':>6}  first failure"]
    for r in rows:
        out.append(f"{r.version:<13} {r.api:<8} {r.verdict:<7} {r.seconds:>6.1f} {r.cpu_seconds:>6.1f}  {r.first_failure or '-'}")
    counts = {k: sum(r.verdict == k for r in rows) for k in ("PASS", "FAIL", "ERROR")}
    out.append(f"{len(rows)} releases: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['ERROR']} ERROR")
    return "\n".join(out)


def run_releases(spec: str, as_json: bool, extra: list[str], log: Callable[[str], None]) -> int:
    try:
        versions = select(spec)
    except (InstallError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows: list[ReleaseRow] = []
    for v in versions:
        log(f"... sglang=={v}")
        rows.append(check_release(v, extra, log))
        log(f"    {rows[-1].verdict} ({rows[-1].seconds}s) {rows[-1].first_failure[:160]}")
    print(json.dumps([asdict(r) for r in rows], indent=2) if as_json else format_table(rows))
    return max((r.exit_code if r.exit_code in (0, 1) else 2 for r in rows), default=0)


