"""Check and record: the two things a user does with a golden."""
from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from harness.cases.case import GOLDEN_FLOAT_FIELDS, Case, default_cases, load_case
from harness.golden.arrays import collect, run_for_golden
from harness.golden.base import FORMAT, GOLDEN_DIR, META_FIELDS, GoldenError, show
from harness.golden.compare import Comparison, compare, field_tol, parse_key
from harness.golden.fingerprint import Fingerprint, config_changes, fingerprint, versions
from harness.golden.place import case_golden_dir, check_writable, record_command
from harness.golden.store import Golden, GoldenPaths, golden_lock, load_golden, recover, write_golden
from harness.run.rig import RankRun

# ----------------------------------------------------------------------------------------
# record and check
# ----------------------------------------------------------------------------------------


def _refusal(case: Case, golden: Golden, fp: Fingerprint, golden_dir: Path) -> Optional[str]:
    m = golden.meta
    why = []
    if m.get("model_fingerprint") != fp.model:
        why.append(f"model config fingerprint {m.get('model_fingerprint')} -> {fp.model}")
    if m.get("weights_fingerprint") != fp.weights:
        why.append(f"model weights hash {m.get('weights_fingerprint')} -> {fp.weights} (the weight init code changed)")
    if m.get("config_hash") != fp.config:
        why.append(f"case config hash {m.get('config_hash')} -> {fp.config}")
    if not why:
        return None
    changes = config_changes(m.get("config", {}), fp.config_dict)
    msg = (f"{show(golden.paths.json)}: refused, this golden was made with other model weights or config than {show(case.path)}: "
           + "; ".join(why) + (f"; changed: {', '.join(changes)}" if changes else "")
           + f". Not compared. If the change is intended, re-record: {record_command(case, golden_dir)}")
    return msg


def check_golden(case: Case, golden_dir: Optional[Path] = None, runs: Optional[Sequence[RankRun]] = None, ranks: str = "sim") -> Comparison:
    """Compare a fresh graph run of the case with its golden (in golden_dir; default: beside the case,
    harness.golden.place). Raises GoldenError when missing or refused."""
    golden_dir = Path(golden_dir) if golden_dir is not None else case_golden_dir(case)
    golden = load_golden(golden_dir, case.name, record_command(case, golden_dir))
    fp = fingerprint(case)
    refused = _refusal(case, golden, fp, golden_dir)
    if refused:
        raise GoldenError(refused)
    got = collect(case, runs if runs is not None else run_for_golden(case, ranks))
    cmp = compare(case, case.name, golden.resolved(), got, show(golden.paths.npz))
    v_then, v_now = golden.meta.get("versions", {}), versions()
    moved = [f"{k} {v_then.get(k)} -> {v_now[k]}" for k in ("torch", "numpy", "machine") if v_then.get(k) != v_now[k]]
    if moved:
        cmp.notes.append("recorded with other versions: " + ", ".join(moved))
    return cmp


def _dedupe(arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Store each distinct array once per field name (the ranks of one attn-TP group produce identical ones)."""
    seen: dict[tuple, str] = {}
    stored, aliases = {}, {}
    for key in sorted(arrays, key=lambda k: (parse_key(k)[0] or 0, k)):
        a = arrays[key]
        sig = (parse_key(key)[3], a.dtype.str, a.shape, hashlib.sha256(np.ascontiguousarray(a).tobytes()).digest())
        if sig in seen:
            aliases[key] = seen[sig]
        else:
            seen.setdefault(sig, key)
            stored[key] = a
    return stored, aliases


@dataclass
class RecordResult:
    case: str
    status: str  # new | changed | unchanged | config-changed
    paths: GoldenPaths
    n_keys: int
    n_bytes: int
    diff: Optional[Comparison] = None
    config_changes: list[str] = field(default_factory=list)
    recovered: Optional[str] = None

    def format(self) -> str:
        size = f"{self.n_keys} keys, {self.n_bytes / 1024:.0f} KiB"
        if self.status == "unchanged":
            return f"{self.case}: unchanged ({size}), {show(self.paths.npz)} not rewritten"
        lines = []
        if self.status == "new":
            lines.append(f"{self.case}: new golden ({size}) -> {show(self.paths.npz)}, {show(self.paths.json)}")
        else:
            lines.append(f"{self.case}: re-recorded ({size}) -> {show(self.paths.npz)}, {show(self.paths.json)}")
        if self.config_changes:
            lines.append("  config changed since the last record: " + ", ".join(self.config_changes))
        if self.diff is not None and not self.diff.ok:
            lines.append("  what changed: " + self.diff.format().replace("\n", "\n  "))
        elif self.diff is not None:
            lines.append("  arrays unchanged; metadata (fingerprints, versions) updated")
        if self.recovered:
            lines.append(f"  ({self.recovered})")
        return "\n".join(lines)


def refuse_under_xdist(golden_dir: Path = GOLDEN_DIR) -> None:
    """Goldens are regenerated serially: xdist workers would race on golden/ (and its acceptance/). (A private
    directory, as tests use under tmp_path, can't race and is allowed.)"""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    d, shipped = Path(golden_dir).resolve(), GOLDEN_DIR.resolve()
    if worker and (d == shipped or shipped in d.parents):
        raise GoldenError(f"refusing to record goldens under pytest-xdist (worker {worker}): workers would race on golden/. "
                          "Regenerate serially: harness golden record <case>|--all")


def record_golden(case: Case, golden_dir: Optional[Path] = None, runs: Optional[Sequence[RankRun]] = None, ranks: str = "sim") -> RecordResult:
    """Run the case's graph runner and write its golden (`<case>.npz` and `<case>.json`) atomically, leaving a golden
    whose arrays are bitwise unchanged untouched. golden_dir defaults to the goldens beside the case
    (harness.golden.place). The JSON records what made it (the model and weights fingerprints, the case config, the
    versions), so a later check refuses a golden made for another config instead of comparing against it. Refused
    before anything runs while a mutant is planted, inside the installed package, or under pytest-xdist into the
    shipped goldens, where workers would race on the files.
    """
    golden_dir = Path(golden_dir) if golden_dir is not None else case_golden_dir(case)
    check_writable(golden_dir)
    refuse_under_xdist(golden_dir)
    arrays = collect(case, runs if runs is not None else run_for_golden(case, ranks))
    fp = fingerprint(case)
    tols = {k: {"rtol": t.rtol, "atol": t.atol, "reason": t.reason} for k in GOLDEN_FLOAT_FIELDS for t in [field_tol(case, k)]}
    stored, aliases = _dedupe(arrays)
    meta = {"format": FORMAT, "case": case.name, "description": case.description, "runner": "graph", "model_fingerprint": fp.model,
            "weights_fingerprint": fp.weights, "config_hash": fp.config, "config": fp.config_dict, "versions": versions(),
            "tolerances": tols, "meta_fields": list(META_FIELDS), "aliases": aliases, "n_keys": len(arrays)}
    p = GoldenPaths.of(golden_dir, case.name)
    recovered = None
    if p.tmp_npz.exists() or p.tmp_json.exists():
        with golden_lock(golden_dir):
            recovered = recover(golden_dir, case.name)
    old: Optional[Golden] = None
    with contextlib.suppress(GoldenError):
        old = load_golden(golden_dir, case.name, record_command(case, golden_dir))
    status, diff, changes = "new", None, []
    if old is not None:
        diff = compare(None, case.name, old.resolved(), arrays, show(p.npz), exact=True)  # what changed: every bit that moved
        exact = diff.ok
        changes = config_changes(old.meta.get("config", {}), fp.config_dict) if old.meta.get("config_hash") != fp.config else []
        same_meta = all(old.meta.get(k) == meta[k] for k in ("model_fingerprint", "weights_fingerprint", "config_hash", "versions", "tolerances",
                                                                "description", "aliases"))
        if exact and same_meta:
            return RecordResult(case.name, "unchanged", p, len(arrays), p.npz.stat().st_size, diff, [], recovered)
        status = "config-changed" if changes else "changed"
    write_golden(golden_dir, case.name, stored, meta)
    return RecordResult(case.name, status, p, len(arrays), p.npz.stat().st_size, diff, changes, recovered)


def iter_cases(names: Sequence[str], all_: bool, cases_dir: Optional[Path] = None) -> list[Case]:

    if names and all_:
        raise GoldenError("name cases or pass --all, not both")
    if not names and not all_:
        raise GoldenError("name a case (e.g. harness golden record tp2_shrink) or pass --all")
    return default_cases(cases_dir) if all_ else [load_case(n, cases_dir) for n in names]

