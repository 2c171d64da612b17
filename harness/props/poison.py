"""P2's replay-twice instrumentation, and its instruments for the graph runners observed inside the loop: the
TARGET_VERIFY runner (`VerifyPoison`) and the single-layer draft decode (`DecodePoison`); the draft-extend runners'
is harness.props.p2's `LanePoison`.

Every replay runs twice from the same state: clean (the subclass checks the canonical fill), and
with the padded lanes and every stale region poisoned; real outputs and the live KV of the
runner's pool must be bit-identical. The clean run's state is what the loop continues with.
Stale regions: every KV slot no running request owns is NaN, and every req_to_token entry outside
the running requests' positions points at one of them, so an index that leaves the live data
reads poison.

The draft decode looks its KV write slots up inside the graph from req_to_token[req_pool_indices,
seq_lens + ...], gathers the rotary table by position and the embedding by token id: a padded lane's
request row, seq_len and position decide where it writes and what it reads. `DecodePoison` instruments
every replay of a running loop, so the gathered branches (attn-TP, MLP-TP gather, DP groups padded to
one bucket) are covered too (harness.props.draft_decode poisons one TP1 replay built by hand).
"""
from __future__ import annotations

from typing import Callable

import torch

from harness.props.outputs import first_bad_row
from harness.run.observe import RunnerObserver
from harness.verdict import Verdict
from runners.decode_cuda_graph_runner import DecodeCudaGraphRunner, VerifyInputs
from runners.draft_extend import SEQ_LEN_FILL_VALUE
from runners.eagle_draft import DraftDecodeInputs, DraftDecodeOutputs
from runners.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
from runners.memory import PADDING_ROW, TokenToKVPool
from runners.spec_decode import SpecEngine
from runners.target import TargetOutput

P2 = "P2"  # the property these instruments report under (registered by harness.props.p2)
NAN = float("nan")
SEQ_SENTINEL = 1 << 30  # seq_lens poisoned far out of range (a mask bound only)


class RunnerPoison:
    """Instruments graph runners of one engine (P2); subclasses name their buffers, their KV pool and the checks."""

    runner: str = ""
    buffers: tuple[str, ...] = ()

    def __init__(self, engine: SpecEngine, verdict: Verdict, *runners):
        self.engine, self.v = engine, verdict
        self.replays = 0
        self.clean = False  # True while the clean replay runs
        self.before_replay: dict = {}  # the snapshot of the replay being checked, taken before it ran
        self.observers: dict[int, RunnerObserver] = {}  # per runner: its replay records name the bucket each replay used
        for g in runners:
            self.observers[id(g)] = RunnerObserver(g).attach()
            g.replay = self._wrap(g, g.replay)

    # ---- what a subclass provides ----
    def kv_pool(self, g) -> TokenToKVPool:
        raise NotImplementedError

    def after_clean(self, g, inp, rec) -> None:
        """The canonical-fill check, when it is read from the buffers after the replay."""

    def poison(self, g, raw_bs: int) -> None:
        raise NotImplementedError

    def compare(self, g, raw_bs: int, bs: int, clean, poisoned, s1: dict) -> None:
        raise NotImplementedError

    # ---- shared ----
    def where(self, raw_bs: int, bs: int) -> dict:
        e = self.engine
        return {"layout": e.ctx.layout.describe(), "runner": self.runner, "rank": e.ctx.tp_rank, "engine_step": e.steps,
                "raw_bs": raw_bs, "bs": bs}

    def live(self) -> tuple[list[int], list[int], list[int]]:
        reqs = [q for q in self.engine.sched.running if q.has_kv]
        return [s for q in reqs for s in q.slots], [q.req_pool_idx for q in reqs], [len(q.slots) for q in reqs]

    def _snap(self, g) -> dict:
        kv = self.kv_pool(g)
        return {"buf": {b: getattr(g, b).clone() for b in self.buffers}, "kv": [t.clone() for t in kv.k + kv.v],
                "rows": self.engine.req_pool.req_to_token.clone()}

    def _restore(self, g, snap: dict) -> None:
        kv = self.kv_pool(g)
        for b, t in snap["buf"].items():
            getattr(g, b).copy_(t)
        for dst, src in zip(kv.k + kv.v, snap["kv"], strict=True):
            dst.copy_(src)
        self.engine.req_pool.req_to_token.copy_(snap["rows"])

    def _wrap(self, g, replay: Callable):
        def poisoned_replay(inp):
            s0 = self.before_replay = self._snap(g)
            self.clean = True
            out_c = replay(inp).cloned()  # the poisoned replay below overwrites the graph's outputs (runners.outputs)
            rec = self.observers[id(g)].replays[-1]
            self.clean = False
            self.after_clean(g, inp, rec)
            s1 = self._snap(g)
            self.check_pad_slots_unwritten(g, self.where(inp.bs, rec.bs), s0, s1)
            self._restore(g, s0)
            self.poison(g, inp.bs)
            out_p = replay(inp)
            self.compare(g, inp.bs, rec.bs, out_c, out_p, s1)
            self._restore(g, s1)
            self.replays += 1
            return out_c

        return poisoned_replay

    def poison_stale(self, g) -> int:
        """NaN in every KV slot no running request owns; req_to_token outside live positions pointing at one. Returns that slot."""
        kv = self.kv_pool(g)
        live_slots, live_rows, live_lens = self.live()
        dead = torch.ones(kv.k[0].shape[0], dtype=torch.bool)
        dead[live_slots] = False
        poison_slot = int(dead.nonzero().max())
        for t in kv.k + kv.v:
            t[dead] = NAN
        rows = self.engine.req_pool.req_to_token
        keep = rows.clone()
        rows.fill_(poison_slot)
        for idx, n in zip(live_rows, live_lens, strict=True):
            rows[idx, :n] = keep[idx, :n]
        return poison_slot

    def check_pad_slots_unwritten(self, g, w: dict, s0: dict, s1: dict) -> None:
        """vLLM's convention: a padded lane writes no KV. The clean replay leaves the null slot 0 (page 0, reserved)
        and the pool's last slot (where a write to -1 lands when a kernel does not skip it and indexes from the end) as
        they were, unless a running request owns them."""
        if not self.engine.req_pool.minus_one:
            return  # SGLang's padded lanes write the dummy slot 0, by design
        live_slots, _, _ = self.live()
        kv = self.kv_pool(g)
        last = kv.k[0].shape[0] - 1
        for slot, what in ((0, "the null slot 0"), (last, f"slot {last}, where -1 lands from the end")):
            if slot in live_slots:
                continue
            self.v.checked += 1
            written = [i for i, (a, b) in enumerate(zip(s0["kv"], s1["kv"], strict=True)) if not torch.equal(a[slot], b[slot])]
            if written:
                self.v.fail("pad-slot", "KV write", {**w, "slot": slot, "kv": written[0]}, "no write (PAD_SLOT_ID is skipped)", "written",
                            f"{what} was written by the replay: a padded lane's KV write was not skipped")

    def compare_live_kv(self, g, w: dict, s1: dict, what: str) -> None:
        live_slots, _, _ = self.live()
        kv = self.kv_pool(g)
        for i, (now, ref) in enumerate(zip(kv.k + kv.v, s1["kv"], strict=True)):
            self.v.checked += 1
            bad = first_bad_row(ref[live_slots], now[live_slots], None) if live_slots else None
            if bad is not None:
                slot = live_slots[bad[0]]
                self.v.fail("poison", what, {**w, "kv": i, "slot": slot}, "bit-identical live KV", "differs",
                            f"live slot {slot} was written differently when the padded lanes were poisoned")
                return


# ---- the TARGET_VERIFY runner ----

_VERIFY_BUFFERS = ("input_ids", "positions", "out_cache_loc", "seq_lens", "req_pool_indices", "custom_mask", "hidden_buffer", "logits_buffer")


class VerifyPoison(RunnerPoison):
    """Instruments one engine's verify runner (P2): after the clean replay the
    padded lanes must hold the canonical fill (tokens and positions 0, the padding row and slot, the
    seq-len fill value, the chain mask); with them and every stale region poisoned, the real rows'
    logits and hidden states and the live target KV must be bit-identical.

    Padded lanes' poison: positions at max_context_len - T (in bounds for the rotary table and the
    node slots root + i, and there a poisoned entry), their mask all True (every node sees every
    node), seq_lens out of range, input_ids vocab_size - 1, the output buffers NaN.
    """

    runner = "target_verify"
    buffers = _VERIFY_BUFFERS

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


def install_verify_poison(poisons: list[VerifyPoison]) -> Callable[[SpecEngine], None]:
    """A SpecSession hook: one VerifyPoison per rank (each with its own verdict)."""

    def hook(engine: SpecEngine) -> None:
        poisons.append(VerifyPoison(engine, Verdict(P2)))

    return hook


# ---- the single-layer draft decode ----

_DECODE_BUFFERS = ("input_ids", "positions", "out_cache_loc", "seq_lens", "req_pool_indices", "topk_p", "topk_index", "hidden_states")


class DecodePoison(RunnerPoison):
    """Instruments one engine's draft-decode runner (P2): when the clean replay's
    graph starts, the padded lanes must hold the canonical fill (the padding row, the seq-len fill
    value, position 0, token 0); with them and every stale region poisoned, the real requests' trees
    and the live draft KV must be bit-identical.

    Padded lanes' poison: a live request's row and a seq_len inside its prefix (a write through them
    lands in live KV), positions at the end of the rotary table less the steps the graph advances
    them, token id vocab_size - 1, NaN top-k probabilities and hidden states.
    """

    runner = "draft_decode"
    buffers = _DECODE_BUFFERS

    def __init__(self, engine: SpecEngine, verdict: Verdict):
        g = engine.draft.decode_graph
        if g is None:
            raise ValueError("DecodePoison needs the single-layer draft's graph runner (runner='graph', draft='single_layer')")
        fill = g._fill_for_replay
        g._fill_for_replay = lambda inp: self._checked_fill(g, fill, inp)
        super().__init__(engine, verdict, g)

    def kv_pool(self, g: EAGLEDraftCudaGraphRunner):
        return g.worker.kv_pool

    def _checked_fill(self, g: EAGLEDraftCudaGraphRunner, fill: Callable, inp: DraftDecodeInputs) -> int:
        """The replay fill, then (clean run) the padded lanes as the graph will read them: it advances the positions in place."""
        bs = fill(inp)
        if self.clean:
            self._check_canonical(g, inp.bs, bs)
        return bs

    def _check_canonical(self, g: EAGLEDraftCudaGraphRunner, raw_bs: int, bs: int) -> None:
        k, w = g.T, self.where(raw_bs, bs)
        if bs == raw_bs:
            return  # no padded lane
        for name, per_lane, want in (("positions", True, 0), ("topk_index", False, 0), ("seq_lens", False, SEQ_LEN_FILL_VALUE),
                                     ("req_pool_indices", False, g.worker.pad.row)):
            start = raw_bs * k if per_lane else raw_bs
            tail = getattr(g, name)[start : bs * k if per_lane else bs]
            self.v.checked += 1
            bad = (tail != want).reshape(tail.shape[0], -1).any(dim=1).nonzero()
            if bad.numel():
                at = start + int(bad[0, 0])
                self.v.fail("canonical", name, {**w, "lane" if per_lane else "request": at}, want, getattr(g, name)[at].tolist(),
                            f"padded {'lane' if per_lane else 'request'} {at} after the draft-decode replay fill")

    def poison(self, g: EAGLEDraftCudaGraphRunner, raw_bs: int) -> None:
        k, cfg = g.T, g.worker.cfg
        self.poison_stale(g)
        _, live_rows, _ = self.live()
        g.req_pool_indices[raw_bs:] = live_rows[0] if live_rows else PADDING_ROW
        g.seq_lens[raw_bs:] = 1  # with a live row: the draft slots from its position 1 on are live KV
        g.positions[raw_bs * k :] = cfg.max_context_len - g.steps - 1
        g.topk_index[raw_bs:] = cfg.vocab_size - 1
        g.topk_p[raw_bs:] = NAN
        g.hidden_states[raw_bs:] = NAN

    def compare(self, g: EAGLEDraftCudaGraphRunner, raw_bs: int, bs: int, clean: DraftDecodeOutputs, poisoned: DraftDecodeOutputs,
                s1: dict) -> None:
        w = self.where(raw_bs, bs)
        for name, t_c in clean.tensors().items():
            t_p = getattr(poisoned, name)
            self.v.checked += 1
            bad = first_bad_row(t_c.reshape(1, -1) if t_c.dim() == 0 else t_c, t_p.reshape(1, -1) if t_p.dim() == 0 else t_p, None)
            if bad is not None:
                self.v.fail("poison", name, {**w, "row": bad[0]}, "bit-identical to the clean replay", f"max |diff| {bad[1]:.3g}",
                            "a real request's draft tree changed when the padded lanes and stale regions were poisoned")
        self.compare_live_kv(g, w, s1, "draft KV")


def install_decode_poison(poisons: list[DecodePoison]) -> Callable[[SpecEngine], None]:
    """A SpecSession hook: one DecodePoison per rank whose draft has a draft-decode graph (each with its own verdict)."""

    def hook(engine: SpecEngine) -> None:
        if getattr(engine.draft, "decode_graph", None) is not None:
            poisons.append(DecodePoison(engine, Verdict(P2)))

    return hook
