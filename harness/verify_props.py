"""P3 and P1 (run path) for the TARGET_VERIFY graph runner, observed inside the speculative loop.

`VerifyShadow` instruments one engine's verify runner from outside: before every replay the
eager verify (`TargetRunner.forward_synced`, the reference path of the same step body) runs
over the same live lanes from the same KV state; the state is put back and the graph
replays. P3: the real rows' logits and hidden states, and the target KV of every live slot
after the pass, equal the eager ones (harness/tolerances.py eager_vs_graph: bitwise but
for the GEMM blocking of the padded M). A padded lane that writes its KV outside the
padding slot into a live slot shows here, at the replay that does it. P1 (I2) on each
replay's record: rows fed to lm_head == the filled for_logprob == the bucket's bs * T.
"""
from __future__ import annotations

import torch

from harness.properties import _first_bad_row, check_replay_rows
from harness.tolerances import eager_vs_graph
from harness.verdict import Verdict
from runners.spec_decode import SpecEngine
from runners.target import Lane
from runners.verify_graph import TargetVerifyCudaGraphRunner, VerifyInputs


def lanes_of(inp: VerifyInputs, T: int) -> list[Lane]:
    """The eager verify's lanes (trees) for the runner's live batch (host reads: harness side only)."""
    ids, pos = inp.input_ids.tolist(), inp.positions.tolist()
    rows = inp.req_pool_indices.tolist()
    return [Lane(rows[i], pos[i * T], ids[i * T : (i + 1) * T], inp.parents[i]) for i in range(inp.bs)]


class VerifyShadow:
    def __init__(self, engine: SpecEngine, p3: Verdict, p1: Verdict):
        self.engine, self.p3, self.p1 = engine, p3, p1
        self.replays = 0
        self.tol = eager_vs_graph(engine.device.type, engine.cfg.dtype, engine.target.attn.name)
        g = engine.verify_graph
        if g is not None:  # None: an eager engine, nothing to compare
            g.replay = self._wrap(g, g.replay)

    def _where(self, raw_bs: int, bs: int) -> dict:
        e = self.engine
        return {"layout": e.ctx.layout.describe(), "runner": "target_verify", "rank": e.ctx.tp_rank, "engine_step": e.steps,
                "raw_bs": raw_bs, "bs": bs}

    def _live_slots(self) -> list[int]:
        return sorted({s for r in self.engine.sched.running if r.has_kv for s in r.slots})

    def _wrap(self, g: TargetVerifyCudaGraphRunner, replay):
        def shadowed(inp: VerifyInputs, record: bool = True):
            e, T = self.engine, g.T
            kv = e.target.kv_pool
            before = [t.clone() for t in kv.k + kv.v]
            ref = e.target.forward_synced(lanes_of(inp, T), [b * T for b in inp.dp_batch_sizes])
            eager_kv = [t.clone() for t in kv.k + kv.v]
            for dst, src in zip(kv.k + kv.v, before, strict=True):
                dst.copy_(src)
            out, rec = replay(inp, record=True)  # the records are what P1 reads, whatever the engine asked for
            w = self._where(inp.bs, rec.bs)
            self._compare(w, ref, out, eager_kv, kv.k + kv.v, T)
            check_replay_rows(self.p1, e.ctx.layout, rec, e.ctx.tp_rank, e.steps, expected_rows=rec.bs * T)
            self.replays += 1
            return out, rec if record else None

        return shadowed

    def _compare(self, w: dict, ref, got, eager_kv: list[torch.Tensor], graph_kv: list[torch.Tensor], T: int) -> None:
        for name in ("logits", "hidden"):
            self.p3.checked += 1
            a, b = getattr(ref, name), getattr(got, name)
            if a.shape != b.shape:
                self.p3.fail("eager-vs-graph", name, w, tuple(a.shape), tuple(b.shape), "shape")
                continue
            bad = _first_bad_row(a, b, self.tol)
            if bad is not None:
                row, err = bad
                self.p3.fail("eager-vs-graph", name, {**w, "row": row}, "match", "differs",
                             f"verify token row {row} (request lane {row // T}), max |diff| {err:.3g}")
        live = self._live_slots()
        if not live:
            return
        half = len(eager_kv) // 2
        for i, (a, b) in enumerate(zip(eager_kv, graph_kv, strict=True)):
            self.p3.checked += 1
            bad = _first_bad_row(a[live], b[live], self.tol)
            if bad is not None:
                row, err = bad
                kind, layer = ("k", i) if i < half else ("v", i - half)
                self.p3.fail("eager-vs-graph", f"target KV ({kind})", {**w, "layer": layer, "slot": live[row]}, "match", "differs",
                             f"live slot {live[row]} after the verify pass, max |diff| {err:.3g}")
                return


def install(shadows: list[VerifyShadow]):
    """A SpecSession hook: one VerifyShadow per rank (ranks are threads: each has its own verdicts)."""

    def hook(engine: SpecEngine) -> None:
        shadows.append(VerifyShadow(engine, Verdict("P3"), Verdict("P1")))

    return hook


def shadow_verdicts(shadows: list[VerifyShadow], where: dict) -> dict[str, Verdict]:
    p3, p1 = Verdict("P3"), Verdict("P1")
    for s in sorted(shadows, key=lambda s: s.engine.ctx.tp_rank):
        p3.merge(s.p3)
        p1.merge(s.p1)
    if any(s.engine.verify_graph is not None for s in shadows):
        p3.checked += 1
        if not any(s.replays for s in shadows):
            p3.fail("replayed", "target verify replays", where, "> 0", 0, "no verify replayed its graph: nothing was compared")
    else:
        p3.notes.append(f"P3 {where}: an eager engine; no TARGET_VERIFY graph to compare")
    return {"P3": p3, "P1": p1}
