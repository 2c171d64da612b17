"""P2's replay-twice instrumentation, shared by the graph runners observed inside the loop (the
TARGET_VERIFY runner, harness.verify_props; the draft decode, harness.props.p2_decode).

Every replay runs twice from the same state: clean (the subclass checks the canonical fill), and
with the padded lanes and every stale region poisoned; real outputs and the live KV of the
runner's pool must be bit-identical. The clean run's state is what the loop continues with.
Stale regions: every KV slot no running request owns is NaN, and every req_to_token entry outside
the running requests' positions points at one of them, so an index that leaves the live data
reads poison.
"""
from __future__ import annotations

from typing import Callable

import torch

from harness.observe import RunnerObserver
from harness.props.outputs import first_bad_row
from harness.verdict import Verdict
from runners.memory import TokenToKVPool
from runners.spec_decode import SpecEngine

NAN = float("nan")


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
