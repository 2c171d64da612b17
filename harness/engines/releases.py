"""`harness engine-check --engine sglang|vllm --releases all|A,B,C|A..B`: install and check each release, one table.

Each release is checked in its own process (`python -m harness.engines --json`: the
adapter stubs imports and swaps module globals process-wide); installing it first is not
timed. The table has one row per release: version, API generation, verdict (PASS exit 0,
FAIL exit 1, ERROR exit 2: the adapter could not drive it, N/A exit 3: the release is outside
what the adapter claims, with the reason), the first failure (or the reason), and the check's
seconds (wall, and CPU of the check process). The exit status is the worst row's among PASS,
FAIL and ERROR; an N/A row is a statement about the adapter's reach, not about the release.
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from harness.engines.drive import NOT_APPLICABLE
from harness.engines.install import InstallError, ensure_installed, version_key
from harness.engines.vllm.install import ensure_vllm_installed

REPO = Path(__file__).resolve().parents[2]
VERDICTS = {0: "PASS", 1: "FAIL", NOT_APPLICABLE: "N/A"}


@dataclass(frozen=True)
class Product:
    """An engine whose releases engine-check can install and check."""

    name: str
    first_release: str  # "all" starts here
    install: Callable[..., Path]
    where_keys: tuple[str, ...]  # the parts of a failure's `where` a table row names


# SGLang: the oldest release whose wheel has the multi-layer draft-extend graph runner
# (sglang/srt/speculative/multi_layer_eagle_draft_extend_cuda_graph_runner.py).
SGLANG = Product("sglang", "0.5.7", ensure_installed, ("branch", "runner", "step", "path", "raw_bs", "bs"))
# vLLM: the oldest release whose model runner v2 has the EAGLE speculator and its graph managers
# (vllm/v1/worker/gpu/spec_decode/eagle_cudagraph.py; later eagle/cudagraph.py, then .../cudagraph_utils.py).
VLLM = Product("vllm", "0.12.0", ensure_vllm_installed, ("dp", "rank", "runner", "num_reqs", "iteration", "raw_bs", "bs"))
PRODUCTS = {p.name: p for p in (SGLANG, VLLM)}
FIRST_RELEASE = SGLANG.first_release


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


def pypi_versions(name: str = "sglang") -> list[str]:
    """Every release of `name` the package index lists (pip's own client), oldest first."""
    proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name, "--disable-pip-version-check"],
                          capture_output=True, text=True)
    for ln in proc.stdout.splitlines():
        if ln.startswith("Available versions:"):
            return sorted((v.strip() for v in ln.split(":", 1)[1].split(",") if v.strip()), key=version_key)
    raise InstallError(f"pip index versions {name} listed no versions (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")


def select(spec: str, available: Optional[Callable[[], list[str]]] = None, product: Product = SGLANG) -> list[str]:
    """`all` (every release from the product's first), `A..B` (the listed releases between, inclusive) or `A,B,C` (as given)."""
    spec = spec.strip()
    if "," in spec or (spec != "all" and ".." not in spec):
        return [v.strip() for v in spec.split(",") if v.strip()]
    known = available() if available is not None else pypi_versions(product.name)
    first = product.first_release
    if spec == "all":
        lo, hi = first, known[-1]
    else:
        lo, hi = (x.strip() for x in spec.split("..", 1))
        lo, hi = lo or first, hi or known[-1]
    picked = [v for v in known if version_key(lo) <= version_key(v) <= version_key(hi)]
    if not picked:
        raise ValueError(f"--releases {spec}: no release between {lo} and {hi} among {known[-5:]}...")
    return picked


def check_release(version: str, extra: list[str], log: Callable[[str], None], product: Product = SGLANG) -> ReleaseRow:
    try:
        product.install(version, log=log)
    except InstallError as e:
        return ReleaseRow(version, "-", "ERROR", 2, f"install: {e}", 0.0, 0.0)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "harness.engines", "--engine", f"{product.name}=={version}", "--json", *extra],
                          cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    verdict = VERDICTS.get(proc.returncode, "ERROR")
    api, first, nfail, nnotes = "-", "", 0, 0
    if proc.returncode in (0, 1):
        rep = json_document(proc.stdout)
        api, nfail, nnotes = rep.get("api", "mrv2"), rep["summary"]["failures"], rep["summary"]["notes"]
        lead = rep.get("first_failure") or next((f for ln in rep["lines"] for f in ln["failures"]), None)
        if lead is not None:  # the failure the report leads with, its `where` shortened
            w = ", ".join(f"{k}={x}" for k, x in lead["where"].items() if k in product.where_keys)
            first = f"{lead['prop']}/{lead['check']} {lead['field']}: expected {lead['expected']}, got {lead['got']} [{w}]"
    elif proc.returncode == NOT_APPLICABLE:
        first = json_document(proc.stdout)["not_covered"]
    else:
        errs = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        first = errs[-1][len("error: "):] if errs else proc.stderr.strip().splitlines()[-1:] and proc.stderr.strip().splitlines()[-1]
    return ReleaseRow(version, api, verdict, proc.returncode, first, round(wall, 1), round(cpu, 1), nfail, nnotes)


def json_document(stdout: str) -> dict:
    """The check's JSON document: the last thing on stdout, after whatever the engine logged there at import."""
    lines = stdout.splitlines()
    start = max(i for i, ln in enumerate(lines) if ln == "{")
    return json.loads("\n".join(lines[start:]))


def format_table(rows: list[ReleaseRow]) -> str:
    out = [f"{'version':<13} {'api':<8} {'verdict':<7} {'wall s':>6} {'cpu s':>6}  first failure"]
    for r in rows:
        out.append(f"{r.version:<13} {r.api:<8} {r.verdict:<7} {r.seconds:>6.1f} {r.cpu_seconds:>6.1f}  {r.first_failure or '-'}")
    counts = {k: sum(r.verdict == k for r in rows) for k in ("PASS", "FAIL", "ERROR", "N/A")}
    out.append(f"{len(rows)} releases: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['ERROR']} ERROR, {counts['N/A']} N/A")
    return "\n".join(out)


def run_releases(spec: str, as_json: bool, extra: list[str], log: Callable[[str], None], product: Product = SGLANG) -> int:
    try:
        versions = select(spec, product=product)
    except (InstallError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows: list[ReleaseRow] = []
    for v in versions:
        log(f"... {product.name}=={v}")
        rows.append(check_release(v, extra, log, product))
        log(f"    {rows[-1].verdict} ({rows[-1].seconds}s) {rows[-1].first_failure[:160]}")
    print(json.dumps([asdict(r) for r in rows], indent=2) if as_json else format_table(rows))
    return max((r.exit_code if r.exit_code in (0, 1) else 2 for r in rows if r.verdict != "N/A"), default=0)


