"""Comparing a run with its golden: per key, exact for ints, within the field's tolerance for floats."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from harness.cases.case import GOLDEN_FLOAT_FIELDS, Case
from harness.golden.arrays import unpack_meta
from harness.golden.base import DEFAULT_TOLERANCES, META_FIELDS
from harness.props.tolerances import Tol

# ----------------------------------------------------------------------------------------
# compare
# ----------------------------------------------------------------------------------------


def parse_key(key: str) -> tuple[Optional[int], Optional[int], Optional[int], str]:
    """'r3.i1.s2.meta.bs' -> (3, 1, 2, 'meta.bs'); 'r0.i1.rids' -> (0, 1, None, 'rids')."""
    parts = key.split(".")
    rank = it = step = None
    i = 0
    for tag in ("r", "i", "s"):
        if i < len(parts) and parts[i][:1] == tag and parts[i][1:].isdigit():
            val = int(parts[i][1:])
            rank, it, step = (val, it, step) if tag == "r" else (rank, val, step) if tag == "i" else (rank, it, val)
            i += 1
    return rank, it, step, ".".join(parts[i:])


@dataclass
class KeyDiff:
    key: str
    kind: str  # values | shape | dtype | missing | extra
    n_diff: int = 0
    n_total: int = 0
    max_abs: Optional[float] = None
    max_rel: Optional[float] = None
    first: list[tuple[int, ...]] = field(default_factory=list)
    expected: Optional[list] = None  # small integer arrays: the values themselves
    got: Optional[list] = None
    tol: Optional[Tol] = None
    first_values: list[tuple[float, float]] = field(default_factory=list)  # (golden, now) at each of `first`
    array_key: str = ""  # the stored array this is part of ('' : the key itself; a metadata field: its packed .meta)

    @property
    def stored(self) -> str:
        return self.array_key or self.key

    @property
    def where(self) -> tuple[Optional[int], Optional[int], Optional[int], str]:
        return parse_key(self.key)

    def to_json(self) -> dict:
        r, i, s, f = self.where
        d = {"key": self.key, "rank": r, "iteration": i, "step": s, "field": f, "kind": self.kind, "n_diff": self.n_diff, "n_total": self.n_total,
             "percent": round(100.0 * self.n_diff / self.n_total, 4) if self.n_total else None, "max_abs": self.max_abs, "max_rel": self.max_rel,
             "first_indices": [list(x) for x in self.first], "first_values": [list(v) for v in self.first_values],
             "expected": self.expected, "got": self.got}
        if self.tol is not None:
            d["tolerance"] = {"rtol": self.tol.rtol, "atol": self.tol.atol}
        return d


def field_tol(case: Optional[Case], name: str) -> Optional[Tol]:
    """The tolerance of a float key's field ('r0.i0.s1.logits' -> logits); None: exact."""
    base = name.rsplit(".", 1)[-1]
    if base not in GOLDEN_FLOAT_FIELDS:
        return None
    default = DEFAULT_TOLERANCES[base]
    return case.tol(f"golden.{base}", default) if case is not None else default


def compare_arrays(key: str, ref: np.ndarray, got: np.ndarray, tol: Optional[Tol]) -> Optional[KeyDiff]:
    if ref.dtype.kind != got.dtype.kind:
        return KeyDiff(key, "dtype", expected=[str(ref.dtype)], got=[str(got.dtype)])
    if ref.shape != got.shape:
        return KeyDiff(key, "shape", expected=list(ref.shape), got=list(got.shape), n_total=int(ref.size))
    if ref.size == 0:
        return None
    if tol is None or ref.dtype.kind in "iub":
        bad = ref != got
        tol = None
    else:
        r64, g64 = ref.astype(np.float64), got.astype(np.float64)
        bad = ~np.isclose(g64, r64, rtol=tol.rtol, atol=tol.atol, equal_nan=True)
    n = int(bad.sum())
    if not n:
        return None
    r64, g64 = ref.astype(np.float64), got.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        err = np.abs(g64 - r64)
        rel = err / np.abs(r64)
    err_b, rel_b = err[bad], rel[bad]
    first = [tuple(int(x) for x in idx) for idx in np.argwhere(bad)[:3]]
    diff = KeyDiff(key, "values", n, int(ref.size), float(np.nanmax(err_b)) if np.isfinite(err_b).any() else float("nan"),
                   float(np.nanmax(rel_b[np.isfinite(rel_b)])) if np.isfinite(rel_b).any() else float("inf"), first, tol=tol,
                   first_values=[(r64[idx].item(), g64[idx].item()) for idx in first])
    if ref.dtype.kind in "iub" and ref.size <= 8:
        diff.expected, diff.got = ref.tolist(), got.tolist()
    return diff


@dataclass
class Comparison:
    case: str
    golden_path: str
    diffs: list[KeyDiff] = field(default_factory=list)
    n_keys: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.diffs

    @property
    def n_differing(self) -> int:
        """Stored keys that differ (a packed .meta key counts once, however many of its fields differ)."""
        return len({d.stored for d in self.diffs})

    def summary(self) -> str:
        if self.ok:
            return f"{self.case}: matches {self.golden_path} ({self.n_keys} keys)"
        return f"{self.case}: {self.n_differing} of {self.n_keys} keys differ from {self.golden_path}"

    def format(self, limit: int = 12) -> str:
        lines = [self.summary()]
        if self.ok:
            return "\n".join(lines + [f"  note: {n}" for n in self.notes])
        head = f"  {'rank':>4} {'iter':>4} {'step':>4}  {'field':<46} {'differ':>20} {'max abs':>9} {'max rel':>9}  first differences"
        lines.append(head)
        diffs = sorted(self.diffs, key=lambda d: tuple(-1 if x is None else x for x in d.where[:3]) + (d.where[3],))
        for d in diffs[:limit]:
            r, i, s, f = d.where
            fmt = lambda x: "-" if x is None else str(x)  # noqa: E731
            if d.kind == "values":
                pct = 100.0 * d.n_diff / d.n_total
                differ = f"{d.n_diff}/{d.n_total} ({pct:.3g}%)"
                if d.expected is not None:
                    detail = f"expected {d.expected}, got {d.got}"
                else:
                    detail = "; ".join(f"at {idx} expected {e:.6g}, got {g:.6g}" for idx, (e, g) in zip(d.first, d.first_values, strict=False))
                    if d.tol is not None:
                        detail += f"  (rtol={d.tol.rtol:g} atol={d.tol.atol:g})"
                num = lambda x: "-" if x is None or x != x else f"{x:.2e}"  # noqa: E731
                lines.append(f"  {fmt(r):>4} {fmt(i):>4} {fmt(s):>4}  {f:<46} {differ:>20} {num(d.max_abs):>9} {num(d.max_rel):>9}  {detail}")
            else:
                what = {"missing": "in the golden, not produced now", "extra": "produced now, not in the golden"}.get(
                    d.kind, f"{d.kind}: expected {d.expected}, got {d.got}")
                lines.append(f"  {fmt(r):>4} {fmt(i):>4} {fmt(s):>4}  {f:<46} {d.kind:>20} {'-':>9} {'-':>9}  {what}")
        if len(diffs) > limit:
            lines.append(f"  ... and {len(diffs) - limit} more differing fields (--limit N shows more, --json all)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"case": self.case, "golden": self.golden_path, "ok": self.ok, "keys": self.n_keys, "differing_keys": self.n_differing,
                "diffs": [d.to_json() for d in self.diffs],
                "notes": self.notes}


def compare(case: Optional[Case], name: str, ref: dict[str, np.ndarray], got: dict[str, np.ndarray], golden_path: str = "",
            exact: bool = False) -> Comparison:
    """Every key: ints exactly, floats within the case's golden tolerance (exact=True: bitwise)."""
    cmp = Comparison(name, golden_path, n_keys=len(set(ref) | set(got)))
    for key in sorted(set(ref) | set(got)):
        if key not in got:
            cmp.diffs.append(KeyDiff(key, "missing"))
        elif key not in ref:
            cmp.diffs.append(KeyDiff(key, "extra"))
        elif key.endswith(".meta"):
            a, b = unpack_meta(ref[key]), unpack_meta(got[key])
            for name in META_FIELDS:
                if a[name] != b[name]:
                    ra, rb = a[name] or [], b[name] or []
                    n = max(len(ra), len(rb), 1)
                    same_len = len(ra) == len(rb) and a[name] is not None and b[name] is not None
                    bad = [k for k in range(len(ra)) if ra[k] != rb[k]] if same_len else list(range(n))
                    err = max(abs(ra[k] - rb[k]) for k in bad) if same_len else None
                    rel = max(abs(ra[k] - rb[k]) / abs(ra[k]) if ra[k] else float("inf") for k in bad) if same_len else None
                    cmp.diffs.append(KeyDiff(f"{key}.{name}", "values", len(bad), n, float(err) if err is not None else None, rel,
                                             [(k,) for k in bad[:3]], a[name], b[name], array_key=key))
        else:
            d = compare_arrays(key, ref[key], got[key], None if exact else field_tol(case, key))
            if d is not None:
                cmp.diffs.append(d)
    return cmp

