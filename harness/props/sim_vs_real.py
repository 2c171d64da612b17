"""Simulated vs real ranks: the same SPMD code must give the same results and the same collectives.

On gloo the comparison is bitwise: DistComm reduces by an all_gather and a left fold in
group-rank order, exactly as the simulated ranks sum, and every rank computes on the
CPU. Measured (2-core CPU, torch 2.13, fp32): every tensor of every step, eager and
graph, bitwise equal on tp2, tp2-dp2 and tp4-dp2 (idle groups included); records and
host metadata equal; traces equal call for call.

On NCCL the reductions are NCCL's own and the math runs on a GPU, so floats compare
within NCCL_TOL (the cross-layout tolerance: a reorder of fp32 sums, three layers deep);
integers, host metadata, replay records and traces still compare exactly.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from harness.props.base import Needs, Property
from harness.props.tolerances import Tol, cross_layout
from harness.ranks.simulated import compare_traces
from harness.ranks.trace import CollectiveCall
from harness.run.records import ReplayRecord, device_independent
from harness.run.rig import RankRun
from harness.verdict import Verdict

PROP = "sim-vs-real"


def real_tolerance(ranks: str, dtype: str) -> Optional[Tol]:
    """None (bitwise) on gloo; the cross-layout tolerance on nccl."""
    return None if ranks == "gloo" else cross_layout(dtype)


def _tensor_diff(a: torch.Tensor, b: torch.Tensor, tol: Optional[Tol]) -> Optional[str]:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    if tol is None or not a.is_floating_point():
        if torch.equal(a, b) or (a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())):
            return None
    elif torch.allclose(b.double(), a.double(), rtol=tol.rtol, atol=tol.atol, equal_nan=True):
        return None
    if a.numel() == 0:
        return None
    err = float((a.double() - b.double()).abs().nan_to_num(float("inf")).max())
    return f"max |diff| {err:.3g} ({'bitwise' if tol is None or not a.is_floating_point() else f'rtol={tol.rtol} atol={tol.atol}'})"


def compare_runs(sim: Sequence[RankRun], real: Sequence[RankRun], tol: Optional[Tol] = None, v: Optional[Verdict] = None) -> Verdict:
    """Every rank's eager and graph outputs, host metadata, replay records and request order."""
    v = v or Verdict(PROP)
    if len(sim) != len(real):
        v.fail("results", "world size", {}, len(sim), len(real))
        return v
    for a, b in zip(sim, real, strict=True):
        w = {"rank": a.rank}
        v.expect_equal("results", "rids", w, a.rids, b.rids)
        for runner in ("eager", "graph"):
            ia, ib = getattr(a, runner), getattr(b, runner)
            if not v.expect_equal("results", f"{runner} iterations", w, len(ia), len(ib)):
                continue
            for it, (sa, sb) in enumerate(zip(ia, ib, strict=True)):
                if not v.expect_equal("results", f"{runner} steps", {**w, "iteration": it}, len(sa), len(sb)):
                    continue
                for step, (ra, rb) in enumerate(zip(sa, sb, strict=True)):
                    ws = {**w, "runner": runner, "iteration": it, "step": step}
                    v.expect_equal("results", "host metadata", ws, ra.host, rb.host)
                    ta, tb = ra.out.tensors(), rb.out.tensors()
                    for name in ta:
                        v.checked += 1
                        d = _tensor_diff(ta[name], tb[name], tol)
                        if d is not None:
                            v.fail("results", name, ws, "simulated ranks' tensor", "differs", d)
        v.expect_equal("results", "replay records", w, _device_independent(a.records), _device_independent(b.records))  # exact on either back end
        stats_a = None if a.stats is None else (a.stats.captures, a.stats.replays, a.stats.eager_fallbacks)
        stats_b = None if b.stats is None else (b.stats.captures, b.stats.replays, b.stats.eager_fallbacks)
        v.expect_equal("results", "graph stats", w, stats_a, stats_b)
    return v


def _device_independent(records: Sequence[Sequence[ReplayRecord]]) -> list[list[ReplayRecord]]:
    return [[device_independent(r) for r in step] for step in records]


def compare_run_traces(sim: Sequence[Sequence[CollectiveCall]], real: Sequence[Sequence[CollectiveCall]], v: Optional[Verdict] = None) -> Verdict:
    v = v or Verdict(PROP)
    v.checked += 1
    diff = compare_traces(sim, real)
    if diff is not None:
        v.fail("traces", "collective trace", {}, "the simulated ranks' trace", "differs", diff)
    return v


PROPERTY = Property(PROP, "simulated vs real ranks", Needs.REAL_RANKS,
                    runs_under="pytest on real ranks")
