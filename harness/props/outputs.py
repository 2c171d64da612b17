"""Tensor comparison shared by P3, P4 and P8: float fields within a tolerance, top-k ids exact up to the reference's ties."""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from harness.verdict import Verdict

FLOAT_FIELDS = ("logits", "hidden", "logprobs", "topk_p")


def _differs(ref: torch.Tensor, got: torch.Tensor, tol) -> torch.Tensor:
    """Elementwise: got differs from ref (in double) past tol (None: bitwise); NaN agrees with NaN."""
    ref, got = ref.double(), got.double()
    if tol is None:
        return ~((ref == got) | (ref.isnan() & got.isnan()))
    return ~torch.isclose(got, ref, rtol=tol.rtol, atol=tol.atol, equal_nan=True)


def first_bad_row(ref: torch.Tensor, got: torch.Tensor, tol) -> tuple[int, float] | None:
    if ref.numel() == 0:
        return None
    bad = _differs(ref, got, tol)
    if ref.dim() > 1:
        bad = bad.reshape(bad.shape[0], -1).any(dim=1)
    if not bad.any():
        return None
    row = int(bad.nonzero()[0, 0])
    return row, float((ref.double() - got.double()).abs().nan_to_num(float("inf")).max())


def first_diffs(ref_row: torch.Tensor, got_row: torch.Tensor, tol, k: int = 3) -> tuple[list[int], list[float], list[float]]:
    """The first k differing elements of one row: their columns, the reference's values and the compared ones."""
    ref, got = ref_row.double().flatten(), got_row.double().flatten()
    bad = _differs(ref, got, tol)
    cols = bad.nonzero().flatten()[:k].tolist()
    return cols, [_value(ref[c]) for c in cols], [_value(got[c]) for c in cols]


def _value(x: torch.Tensor) -> float | str:
    """Six digits, what a person compares at a glance; a non-finite value as its name (JSON has no NaN)."""
    f = float(x)
    return float(f"{f:.6g}") if math.isfinite(f) else str(f)


def compare_outputs(v: Verdict, check: str, where: dict, ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], tol,
                    row_label=lambda r: f"row {r}") -> bool:
    """Compare float fields with tol (None: bitwise) and top-k ids exactly up to ties of the reference.

    Returns False when top-1 ids differ (a tie flip or a real bug): later steps then see
    different inputs, and the caller stops comparing them.
    """
    same_path = True
    for name in FLOAT_FIELDS:
        v.checked += 1
        if ref[name].shape != got[name].shape:
            v.fail(check, name, where, tuple(ref[name].shape), tuple(got[name].shape), "shape")
            continue
        bad = first_bad_row(ref[name], got[name], tol)
        if bad is not None:
            row, err = bad
            tol_s = "bitwise" if tol is None else f"rtol={tol.rtol} atol={tol.atol}"
            cols, want, have = first_diffs(ref[name][row], got[name][row], tol)
            what = row_label(row) if name in ("logits", "hidden") else f"request row {row}"
            v.fail(check, name, where, want, have,
                   f"first differing {what} at column(s) {cols} (expected, got); max |diff| {err:.3g} over the tensor ({tol_s})")
    v.checked += 1
    ids_ref, ids_got = ref["topk_index"], got["topk_index"]
    if ids_ref.shape != ids_got.shape:
        v.fail(check, "topk_index", where, tuple(ids_ref.shape), tuple(ids_got.shape), "shape")
        return False
    if not torch.equal(ids_ref, ids_got):
        p = ref["logprobs"].exp()
        margin = tol.atol if tol is not None else 0.0
        diff_rows = (ids_ref != ids_got).any(dim=1).nonzero().flatten().tolist()
        for row in diff_rows:
            if not bool(((ids_got[row] >= 0) & (ids_got[row] < p.shape[-1])).all()):  # garbage (a poisoned or stale read)
                v.fail(check, "topk_index", where, ids_ref[row].tolist(), ids_got[row].tolist(), f"request row {row}; an id outside the vocabulary")
                break
            pr = p[row, ids_ref[row]]
            pg = p[row, ids_got[row]]
            if (pr - pg).abs().max() > margin:
                v.fail(check, "topk_index", where, ids_ref[row].tolist(), ids_got[row].tolist(), f"request row {row}; not a tie of the reference")
                break
        else:
            v.notes.append(f"{check} {where}: top-k tie within tolerance at rows {diff_rows}; later steps not compared")
        same_path = False
    return same_path



def compare_requests(v: Verdict, check: str, items: Sequence[tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor], Callable]], tol,
                     ) -> list[bool]:
    """compare_outputs on each (where, ref, got, row_label) of one step's requests, in order; its return for each.

    The requests that agree (every field's shape, the float fields within tol, the top-k ids equal) are found for all
    of them at once, one comparison per field, and counted as compare_outputs counts a request it passes; the others go
    through compare_outputs, which reports them (or finds a top-k tie). A passing request is the common case: its
    fields are a few rows each, so a comparison per request per field cost more than the comparison itself."""
    agree = _agreeing([(ref, got) for _, ref, got, _ in items], tol)
    out = []
    for (where, ref, got, label), ok in zip(items, agree, strict=True):
        if ok:
            v.checked += len(FLOAT_FIELDS) + 1  # compare_outputs': each float field, then the top-k ids
            out.append(True)
        else:
            out.append(compare_outputs(v, check, where, ref, got, tol, label))
    return out


def _agreeing(pairs: Sequence[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]], tol) -> list[bool]:
    """Per (ref, got) pair: compare_outputs would find nothing (fails none, notes none, returns True). Where the
    requests' fields are not all of one shape (not rows of one batch), none is known to agree."""
    fields = (*FLOAT_FIELDS, "topk_index")
    shapes = {(f, ref[f].shape, got[f].shape) for ref, got in pairs for f in fields}
    if not pairs or len(shapes) != len(fields) or any(a != b for _, a, b in shapes):
        return [False] * len(pairs)
    n = len(pairs)

    def side(k: int, names: Sequence[str]) -> torch.Tensor:  # [n, the named fields' elements of a request, side by side]
        return torch.cat([torch.stack([p[k][f] for p in pairs]).reshape(n, -1).double() for f in names], dim=1)

    floats = side(0, FLOAT_FIELDS), side(1, FLOAT_FIELDS)  # one tolerance for every float field: compared at once
    differs = _differs(*floats, tol).any(dim=1) if floats[0].shape[1] else torch.zeros(n, dtype=torch.bool)
    ids = torch.stack([ref["topk_index"] for ref, _ in pairs]).reshape(n, -1), torch.stack([got["topk_index"] for _, got in pairs]).reshape(n, -1)
    if ids[0].shape[1]:
        differs |= (ids[0] != ids[1]).any(dim=1)  # the ids exactly, as torch.equal
    return (~differs).tolist()
