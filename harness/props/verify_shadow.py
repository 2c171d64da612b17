"""P3, P1 (run path) and P5 (tree vs chain) for the TARGET_VERIFY graph runner, observed inside the speculative loop.

`VerifyShadow` instruments one engine's verify runner from outside: before every replay the
eager verify (`TargetRunner.forward_synced`, the reference path of the same step body) runs
over the same live lanes from the same KV state; the state is put back and the graph
replays. P3: the real rows' logits and hidden states, and the target KV of every live slot
after the pass, equal the eager ones (harness/props/tolerances.py eager_vs_graph: bitwise but
for the GEMM blocking of the padded M). A padded lane that writes its KV outside the
padding slot into a live slot shows here, at the replay that does it. P1 (I2) on each
replay's record: rows fed to lm_head == the filled for_logprob == the bucket's bs * T.
(P2 of the same runner: harness.props.poison.VerifyPoison.)
"""
from __future__ import annotations

from typing import Optional

import torch

from harness.props.outputs import first_bad_row
from harness.props.p1_records import check_replay_rows
from harness.props.tolerances import eager_vs_graph
from harness.run.observe import RunnerObserver
from harness.verdict import Verdict
from runners.decode_cuda_graph_runner import DecodeCudaGraphRunner, VerifyInputs
from runners.spec_decode import SpecEngine
from runners.target import Lane, TargetOutput

P1, P3, P5 = "P1", "P3", "P5"  # what a verify replay shows: its record (I2), eager vs graph, the tree vs its chains


def lanes_of(inp: VerifyInputs, T: int) -> list[Lane]:
    """The eager verify's lanes (trees) for the runner's live batch (host reads: harness side only)."""
    ids, pos = inp.input_ids.tolist(), inp.positions.tolist()
    rows = inp.req_pool_indices.tolist()
    parents = inp.parents or [list(range(-1, T - 1))] * inp.bs
    return [Lane(rows[i], pos[i * T], ids[i * T : (i + 1) * T], parents[i]) for i in range(inp.bs)]


def path_lanes(inp: VerifyInputs, T: int, k: int) -> tuple[list[Lane], list[int]]:
    """Every lane's k-th node off its parent's next slot (a top-k sibling), as a chain lane of its path
    from the root (its ancestors' tokens at consecutive positions), and the node's verify row."""
    lanes, rows = [], []
    for b, par in enumerate(inp.parents):  # [] (chains): no sibling
        off = [i for i in range(1, T) if par[i] != i - 1]
        if k < len(off):
            path = [off[k]]
            while par[path[-1]] >= 0:
                path.append(par[path[-1]])
            ids = inp.input_ids[b * T : (b + 1) * T].tolist()
            lanes.append(Lane(int(inp.req_pool_indices[b]), int(inp.positions[b * T]), [ids[i] for i in reversed(path)]))
            rows.append(b * T + off[k])
    return lanes, rows


class VerifyShadow:
    """P3 and P1 of every verify replay; on a tree engine also P5's tree-vs-chain: every sibling node's
    logits in the (eager) tree verify equal those of its path run as a plain chain, whose positions
    and KV columns are consecutive and need no tree (an independent reference for the mask, the
    depth positions and the node slots)."""

    def __init__(self, engine: SpecEngine, p3: Verdict, p1: Verdict, p5: Optional[Verdict] = None):
        self.engine, self.p3, self.p1, self.p5 = engine, p3, p1, p5 if p5 is not None else Verdict(P5)
        self.replays = 0
        self.tol = eager_vs_graph(engine.device.type, engine.cfg.dtype, engine.target.attn.name)
        g = engine.verify_graph
        if g is not None:  # None: an eager engine, nothing to compare
            self.observer = RunnerObserver(g).attach()
            g.replay = self._wrap(g, g.replay)

    def _where(self, raw_bs: int, bs: int) -> dict:
        e = self.engine
        return {"layout": e.ctx.layout.describe(), "runner": "target_verify", "rank": e.ctx.tp_rank, "engine_step": e.steps,
                "raw_bs": raw_bs, "bs": bs}

    def _live_slots(self) -> list[int]:
        return sorted({s for r in self.engine.sched.running if r.has_kv for s in r.slots})

    def _wrap(self, g: DecodeCudaGraphRunner, replay):
        def shadowed(inp: VerifyInputs) -> TargetOutput:
            e, T = self.engine, g.T
            kv = e.target.kv_pool
            before = [t.clone() for t in kv.k + kv.v]
            ref = e.target.forward_synced(lanes_of(inp, T), [b * T for b in inp.dp_batch_sizes])
            eager_kv = [t.clone() for t in kv.k + kv.v]
            if e.tree:
                self._tree_vs_chain(inp, T, ref)
            for dst, src in zip(kv.k + kv.v, before, strict=True):
                dst.copy_(src)
            out = replay(inp)
            rec = self.observer.replays[-1]
            w = self._where(inp.bs, rec.bs)
            self._compare(w, ref, out, eager_kv, kv.k + kv.v, T)
            check_replay_rows(self.p1, e.ctx.layout, rec, e.ctx.tp_rank, e.steps, expected_rows=rec.bs * T)
            self.replays += 1
            return out

        return shadowed

    def _tree_vs_chain(self, inp: VerifyInputs, T: int, ref: TargetOutput) -> None:
        """One eager pass per sibling index k (a request's chain lanes would collide on its KV columns
        in one pass); T - 1 passes on every rank alike, each with its own MLP sync. The pool is put
        back by the caller."""
        for k in range(T - 1):
            lanes, rows = path_lanes(inp, T, k)
            out = self.engine.target.forward(lanes)
            if out is None or not lanes:
                continue
            ends = [sl.stop - 1 for sl in out.lane_rows(lanes)]
            self.p5.checked += 1
            bad = first_bad_row(out.logits[ends], ref.logits[rows], self.tol)
            if bad is not None:
                i, err = bad
                self.p5.fail("tree-vs-chain", "logits", {**self._where(inp.bs, inp.bs), "row": rows[i]}, "the logits of its path as a chain",
                             "differs", f"tree node at verify row {rows[i]} (request lane {rows[i] // T}), max |diff| {err:.3g}")
                return

    def _compare(self, w: dict, ref, got, eager_kv: list[torch.Tensor], graph_kv: list[torch.Tensor], T: int) -> None:
        for name in ("logits", "hidden"):
            self.p3.checked += 1
            a, b = getattr(ref, name), getattr(got, name)
            if a.shape != b.shape:
                self.p3.fail("eager-vs-graph", name, w, tuple(a.shape), tuple(b.shape), "shape")
                continue
            bad = first_bad_row(a, b, self.tol)
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
            bad = first_bad_row(a[live], b[live], self.tol)
            if bad is not None:
                row, err = bad
                kind, layer = ("k", i) if i < half else ("v", i - half)
                self.p3.fail("eager-vs-graph", f"target KV ({kind})", {**w, "layer": layer, "slot": live[row]}, "match", "differs",
                             f"live slot {live[row]} after the verify pass, max |diff| {err:.3g}")
                return


def install(shadows: list[VerifyShadow]):
    """A SpecSession hook: one VerifyShadow per rank (ranks are threads: each has its own verdicts)."""

    def hook(engine: SpecEngine) -> None:
        shadows.append(VerifyShadow(engine, Verdict(P3), Verdict(P1), Verdict(P5)))

    return hook


def shadow_verdicts(shadows: list[VerifyShadow], where: dict) -> dict[str, Verdict]:
    p3, p1, p5 = Verdict(P3), Verdict(P1), Verdict(P5)
    for s in sorted(shadows, key=lambda s: s.engine.ctx.tp_rank):
        p3.merge(s.p3)
        p1.merge(s.p1)
        p5.merge(s.p5)
    if any(s.engine.verify_graph is not None for s in shadows):
        p3.checked += 1
        if not any(s.replays for s in shadows):
            p3.fail("replayed", "target verify replays", where, "> 0", 0, "no verify replayed its graph: nothing was compared")
    else:
        p3.notes.append(f"{P3} {where}: an eager engine; no TARGET_VERIFY graph to compare")
    return {P3: p3, P1: p1, P5: p5}
