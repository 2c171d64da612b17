"""P2 over the single-layer draft decode's graph runner inside the loop, on any layout: the replay fill
leaves canonical padded lanes, and poisoning them and every stale region changes no real tree and no live KV.

The draft decode looks its KV write slots up inside the graph from req_to_token[req_pool_indices,
seq_lens + ...], gathers the rotary table by position and the embedding by token id: a padded lane's
request row, seq_len and position decide where it writes and what it reads. harness.decode_props
poisons one TP1 replay built by hand; this instruments every replay of a running loop, so the
gathered branches (attn-TP, MLP-TP gather, DP groups padded to one bucket) are covered too.
"""
from __future__ import annotations

from typing import Callable

import torch

from harness.props.outputs import first_bad_row
from harness.verdict import Verdict
from runners.draft_extend import SEQ_LEN_FILL_VALUE
from runners.eagle_draft import DraftDecodeInputs, DraftDecodeOutputs
from runners.eagle_draft_graph import EAGLEDraftCudaGraphRunner
from runners.memory import PADDING_ROW
from runners.spec_decode import SpecEngine

NAN = float("nan")
_BUFFERS = ("input_ids", "positions", "out_cache_loc", "seq_lens", "req_pool_indices", "topk_p", "topk_index", "hidden_states")


class DecodePoison:
    """Instruments one engine's draft-decode runner (P2). Every replay runs twice from the same state:
    clean (the padded lanes must hold the canonical fill when the graph starts: the padding row, the
    seq-len fill value, position 0, token 0), and with the padded lanes and every stale region
    poisoned; the real requests' trees and the live draft KV must be bit-identical. The clean run's
    state is what the loop continues with.

    Poison: every draft KV slot no running request owns NaN, every req_to_token entry outside the
    running requests' positions pointing at one of them; padded lanes: a live request's row and a
    seq_len inside its prefix (a write through them lands in live KV), positions at the end of the
    rotary table less the steps the graph advances them, token id vocab_size - 1, NaN top-k
    probabilities and hidden states.
    """

    def __init__(self, engine: SpecEngine, verdict: Verdict):
        self.engine, self.v = engine, verdict
        self.replays = 0
        g = engine.draft.decode_graph
        if g is None:
            raise ValueError("DecodePoison needs the single-layer draft's graph runner (runner='graph', draft='single_layer')")
        self.raw_bs = 0
        fill = g._fill_for_replay
        g._fill_for_replay = lambda inp: self._checked_fill(g, fill, inp)
        g.replay = self._wrap(g, g.replay)
        self.check_fill = False

    def _where(self, raw_bs: int, bs: int) -> dict:
        e = self.engine
        return {"layout": e.ctx.layout.describe(), "runner": "draft_decode", "rank": e.ctx.tp_rank, "engine_step": e.steps,
                "raw_bs": raw_bs, "bs": bs}

    def _live(self) -> tuple[list[int], list[int], list[int]]:
        reqs = [q for q in self.engine.sched.running if q.has_kv]
        return [s for q in reqs for s in q.slots], [q.req_pool_idx for q in reqs], [len(q.slots) for q in reqs]

    def _snap(self, g: EAGLEDraftCudaGraphRunner) -> dict:
        kv = g.worker.kv_pool
        return {"buf": {b: getattr(g, b).clone() for b in _BUFFERS}, "kv": [t.clone() for t in kv.k + kv.v],
                "rows": g.worker.req_pool.req_to_token.clone()}

    def _restore(self, g: EAGLEDraftCudaGraphRunner, snap: dict) -> None:
        kv = g.worker.kv_pool
        for b, t in snap["buf"].items():
            getattr(g, b).copy_(t)
        for dst, src in zip(kv.k + kv.v, snap["kv"], strict=True):
            dst.copy_(src)
        g.worker.req_pool.req_to_token.copy_(snap["rows"])

    def _checked_fill(self, g: EAGLEDraftCudaGraphRunner, fill: Callable, inp: DraftDecodeInputs) -> int:
        """The replay fill, then (clean run) the padded lanes as the graph will read them."""
        bs = fill(inp)
        if self.check_fill:
            self._check_canonical(g, inp.bs, bs)
        return bs

    def _wrap(self, g: EAGLEDraftCudaGraphRunner, replay: Callable):
        def poisoned_replay(inp: DraftDecodeInputs, record: bool = True):
            s0 = self._snap(g)
            self.check_fill = True
            out_c, rec = replay(inp, record=True)  # the record names the bucket, whatever the engine asked for
            self.check_fill = False
            s1 = self._snap(g)
            self._restore(g, s0)
            self._poison(g, inp.bs)
            out_p, _ = replay(inp, record=False)
            self._compare(g, inp.bs, rec.bs, out_c, out_p, s1)
            self._restore(g, s1)
            self.replays += 1
            return out_c, rec if record else None

        return poisoned_replay

    def _check_canonical(self, g: EAGLEDraftCudaGraphRunner, raw_bs: int, bs: int) -> None:
        k, w = g.T, self._where(raw_bs, bs)
        if bs == raw_bs:
            return  # no padded lane
        for name, per_lane, want in (("positions", True, 0), ("topk_index", False, 0), ("seq_lens", False, SEQ_LEN_FILL_VALUE),
                                     ("req_pool_indices", False, PADDING_ROW)):
            start = raw_bs * k if per_lane else raw_bs
            tail = getattr(g, name)[start : bs * k if per_lane else bs]
            self.v.checked += 1
            bad = (tail != want).reshape(tail.shape[0], -1).any(dim=1).nonzero()
            if bad.numel():
                at = start + int(bad[0, 0])
                self.v.fail("canonical", name, {**w, "lane" if per_lane else "request": at}, want, getattr(g, name)[at].tolist(),
                            f"padded {'lane' if per_lane else 'request'} {at} after the draft-decode replay fill")

    def _poison(self, g: EAGLEDraftCudaGraphRunner, raw_bs: int) -> None:
        k, cfg, kv = g.T, g.worker.cfg, g.worker.kv_pool
        live_slots, live_rows, live_lens = self._live()
        dead = torch.ones(kv.k[0].shape[0], dtype=torch.bool)
        dead[live_slots] = False
        poison_slot = int(dead.nonzero().max())
        for t in kv.k + kv.v:
            t[dead] = NAN
        rows = g.worker.req_pool.req_to_token
        keep = rows.clone()
        rows.fill_(poison_slot)
        for idx, n in zip(live_rows, live_lens, strict=True):
            rows[idx, :n] = keep[idx, :n]
        victim = live_rows[0] if live_rows else PADDING_ROW
        g.req_pool_indices[raw_bs:] = victim
        g.seq_lens[raw_bs:] = 1  # with the victim's row: the draft slots from its position 1 on are live KV
        g.positions[raw_bs * k :] = cfg.max_context_len - g.steps - 1
        g.topk_index[raw_bs:] = cfg.vocab_size - 1
        g.topk_p[raw_bs:] = NAN
        g.hidden_states[raw_bs:] = NAN

    def _compare(self, g: EAGLEDraftCudaGraphRunner, raw_bs: int, bs: int, clean: DraftDecodeOutputs, poisoned: DraftDecodeOutputs,
                 s1: dict) -> None:
        w = self._where(raw_bs, bs)
        for name, t_c in clean.tensors().items():
            t_p = getattr(poisoned, name)
            self.v.checked += 1
            bad = first_bad_row(t_c.reshape(1, -1) if t_c.dim() == 0 else t_c, t_p.reshape(1, -1) if t_p.dim() == 0 else t_p, None)
            if bad is not None:
                self.v.fail("poison", name, {**w, "row": bad[0]}, "bit-identical to the clean replay", f"max |diff| {bad[1]:.3g}",
                            "a real request's draft tree changed when the padded lanes and stale regions were poisoned")
        live_slots, _, _ = self._live()
        kv = g.worker.kv_pool
        for i, (now, ref) in enumerate(zip(kv.k + kv.v, s1["kv"], strict=True)):
            self.v.checked += 1
            bad = first_bad_row(ref[live_slots], now[live_slots], None) if live_slots else None
            if bad is not None:
                slot = live_slots[bad[0]]
                self.v.fail("poison", "draft KV", {**w, "kv": i, "slot": slot}, "bit-identical live KV", "differs",
                            f"live slot {slot} was written differently when the padded lanes were poisoned")
                return


def install_decode_poison(poisons: list[DecodePoison]) -> Callable[[SpecEngine], None]:
    """A SpecSession hook: one DecodePoison per rank whose draft has a draft-decode graph (each with its own verdict)."""

    def hook(engine: SpecEngine) -> None:
        if getattr(engine.draft, "decode_graph", None) is not None:
            poisons.append(DecodePoison(engine, Verdict("P2")))

    return hook
