"""P3, P1 (run path) and P2 for the TARGET_VERIFY graph runner, observed inside the speculative loop.

`VerifyShadow` instruments one engine's verify runner from outside: before every replay the
eager verify (`TargetRunner.forward_synced`, the reference path of the same step body) runs
over the same live lanes from the same KV state; the state is put back and the graph
replays. P3: the real rows' logits and hidden states, and the target KV of every live slot
after the pass, equal the eager ones (harness/tolerances.py eager_vs_graph: bitwise but
for the GEMM blocking of the padded M). A padded lane that writes its KV outside the
padding slot into a live slot shows here, at the replay that does it. P1 (I2) on each
replay's record: rows fed to lm_head == the filled for_logprob == the bucket's bs * T.
`VerifyPoison` (P2): the padded lanes' replay fill, and poisoned padded lanes that no real row
or live slot may see.
"""
from __future__ import annotations

from typing import Optional

import torch

from harness.observe import RunnerObserver
from harness.props.outputs import first_bad_row
from harness.props.p1_records import check_replay_rows
from harness.props.poison import NAN, RunnerPoison
from harness.tolerances import eager_vs_graph
from harness.verdict import Verdict
from runners.decode_cuda_graph_runner import DecodeCudaGraphRunner, VerifyInputs
from runners.draft_extend import SEQ_LEN_FILL_VALUE
from runners.memory import PADDING_ROW
from runners.spec_decode import SpecEngine
from runners.target import Lane, TargetOutput


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
        self.engine, self.p3, self.p1, self.p5 = engine, p3, p1, p5 if p5 is not None else Verdict("P5")
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
        shadows.append(VerifyShadow(engine, Verdict("P3"), Verdict("P1"), Verdict("P5")))

    return hook


def shadow_verdicts(shadows: list[VerifyShadow], where: dict) -> dict[str, Verdict]:
    p3, p1, p5 = Verdict("P3"), Verdict("P1"), Verdict("P5")
    for s in sorted(shadows, key=lambda s: s.engine.ctx.tp_rank):
        p3.merge(s.p3)
        p1.merge(s.p1)
        p5.merge(s.p5)
    if any(s.engine.verify_graph is not None for s in shadows):
        p3.checked += 1
        if not any(s.replays for s in shadows):
            p3.fail("replayed", "target verify replays", where, "> 0", 0, "no verify replayed its graph: nothing was compared")
    else:
        p3.notes.append(f"P3 {where}: an eager engine; no TARGET_VERIFY graph to compare")
    return {"P3": p3, "P1": p1, "P5": p5}


# ----------------------------------------------------------------------------------------
# P2 over the TARGET_VERIFY runner: canonical padded lanes after the fill; poisoned replays change nothing real
# ----------------------------------------------------------------------------------------

SEQ_SENTINEL = 1 << 30  # seq_lens poisoned far out of range (a mask bound only)
_BUFFERS = ("input_ids", "positions", "out_cache_loc", "seq_lens", "req_pool_indices", "custom_mask", "hidden_buffer", "logits_buffer")


class VerifyPoison(RunnerPoison):
    """Instruments one engine's verify runner (P2, harness.props.poison): after the clean replay the
    padded lanes must hold the canonical fill (tokens and positions 0, the padding row and slot, the
    seq-len fill value, the chain mask); with them and every stale region poisoned, the real rows'
    logits and hidden states and the live target KV must be bit-identical.

    Padded lanes' poison: positions at max_context_len - T (in bounds for the rotary table and the
    node slots root + i, and there a poisoned entry), their mask all True (every node sees every
    node), seq_lens out of range, input_ids vocab_size - 1, the output buffers NaN.
    """

    runner = "target_verify"
    buffers = _BUFFERS

    def __init__(self, engine: SpecEngine, verdict: Verdict):
        if engine.verify_graph is None:
            raise ValueError("VerifyPoison needs the graph runner (runner='graph')")
        super().__init__(engine, verdict, engine.verify_graph)

    def kv_pool(self, g: DecodeCudaGraphRunner):
        return self.engine.target.kv_pool

    def after_clean(self, g: DecodeCudaGraphRunner, inp: VerifyInputs, rec) -> None:
        raw_bs, bs = inp.bs, rec.bs
        T, w = g.T, self.where(raw_bs, bs)
        raw_n = raw_bs * T
        # The fill covers the bucket's padded lanes only (lanes past the bucket are never read), so that is what is checked
        for name, per_token, want in (("input_ids", True, 0), ("positions", True, 0), ("out_cache_loc", True, g.pad.slot),
                                      ("seq_lens", False, SEQ_LEN_FILL_VALUE), ("req_pool_indices", False, g.pad.row)):
            start, stop = (raw_n, bs * T) if per_token else (raw_bs, bs)
            tail = getattr(g, name)[start:stop]
            self.v.checked += 1
            bad = (tail != want).nonzero()
            if bad.numel():
                at = start + int(bad[0, 0])
                self.v.fail("canonical", name, {**w, "row" if per_token else "lane": at}, want, int(getattr(g, name)[at]),
                            f"padded {'token row' if per_token else 'lane'} {at} after the verify replay fill")
        self.v.checked += 1
        stale = (g.custom_mask[raw_bs:bs] != g.chain_mask).flatten(1).any(dim=1).nonzero()
        if stale.numel():
            lane = raw_bs + int(stale[0, 0])
            self.v.fail("canonical", "custom_mask", {**w, "lane": lane}, "the chain mask", "another mask",
                        f"padded lane {lane}'s tree mask after the verify replay fill")
        if g.global_num_tokens_gpu is not None:
            self.v.expect_equal("canonical", "global_num_tokens_gpu (replay fill)", w, [bs * T] * g.global_num_tokens_gpu.shape[0],
                                g.global_num_tokens_gpu.tolist())

    def poison(self, g: DecodeCudaGraphRunner, raw_bs: int) -> None:
        T, cfg = g.T, g.cfg
        raw_n = raw_bs * T
        poison_slot = self.poison_stale(g)
        g.input_ids[raw_n:] = cfg.vocab_size - 1
        g.positions[raw_n:] = cfg.max_context_len - T
        g.out_cache_loc[raw_n:] = poison_slot
        g.seq_lens[raw_bs:] = SEQ_SENTINEL
        g.req_pool_indices[raw_bs:] = PADDING_ROW
        g.custom_mask[raw_bs:] = True
        g.hidden_buffer.fill_(NAN)
        g.logits_buffer.fill_(NAN)

    def compare(self, g: DecodeCudaGraphRunner, raw_bs: int, bs: int, clean: TargetOutput, poisoned: TargetOutput, s1: dict) -> None:
        w, T = self.where(raw_bs, bs), g.T
        for name in ("logits", "hidden"):
            self.v.checked += 1
            bad = first_bad_row(getattr(clean, name), getattr(poisoned, name), None)
            if bad is not None:
                row = bad[0]
                nan = bool(getattr(poisoned, name)[row].isnan().any())
                self.v.fail("poison", name, {**w, "row": row}, "bit-identical to the clean replay", "NaN (a poisoned value)" if nan else "differs",
                            f"real verify token row {row} (request lane {row // T}) {'read a poisoned value' if nan else 'changed'} "
                            "when the padded lanes and stale regions were poisoned")
        self.compare_live_kv(g, w, s1, "target KV")


def install_poison(poisons: list[VerifyPoison]):
    """A SpecSession hook: one VerifyPoison per rank (each with its own verdict)."""

    def hook(engine: SpecEngine) -> None:
        poisons.append(VerifyPoison(engine, Verdict("P2")))

    return hook
