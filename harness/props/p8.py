"""P8 batch churn: eager and graph engines side by side under adds, finishes, preemptions and resumes; ChurnPair is the
state a stateful test drives, and the churn scripts below are the mutant probes' fixed schedules."""
from __future__ import annotations

from typing import Sequence

import torch

from harness.props.base import Needs, Probe, Property
from harness.props.outputs import compare_outputs, first_bad_row
from harness.props.p3 import check_loop_replayed
from harness.props.p5 import TIE_MARGIN
from harness.props.tolerances import eager_vs_graph
from harness.ranks.simulated import RankFailure
from harness.run.case_run import RUN
from harness.run.crash import crash_verdict
from harness.run.loop import DEFAULT_MODEL, SpecSession, oracle, request_prompt
from harness.verdict import Verdict
from runners.config import ModelConfig, SpecConfig
from runners.parallel.layout import ParallelLayout

P8 = "P8"
TREE_EXACT, TREE_CLOSE = ("tokens", "parents", "child_index"), ("scores", "child_p")  # the draft-decode tree, per request

class ChurnPair:
    """Eager and graph engines on one layout fed the same commands; `check()` after every step.

    Commands queue up and reach both sessions with the next step (requests arrive, finish and
    are preempted between scheduler iterations). `running`/`waiting` mirror the scheduler so
    rules can pick valid targets; natural finishes are read back after each step.
    """

    def __init__(self, layout: ParallelLayout, spec: SpecConfig, model: ModelConfig = DEFAULT_MODEL, seed: int = 0):
        self.layout, self.spec, self.model, self.seed = layout, spec, model, seed
        self.eager = SpecSession(layout, spec, model, runner="eager")
        self.graph = SpecSession(layout, spec, model, runner="graph")
        self.v = Verdict(P8)
        self.pending: list[tuple] = []
        self.next_rid = 0
        dp = layout.attn_dp_size
        self.running: list[list[int]] = [[] for _ in range(dp)]
        self.waiting: list[list[int]] = [[] for _ in range(dp)]
        self.diverged: set[int] = set()  # requests whose eager/graph drafts split at a near-tie
        self.tol = eager_vs_graph("cpu", model.dtype)
        self._oracle: dict[int, object] = {}
        self.steps = 0

    # ---- rules ----
    def room(self, d: int) -> int:
        return self.spec.max_running_requests - len(self.running[d])

    def add(self, d: int, k: int) -> None:
        for _ in range(min(k, self.room(d))):
            prompt, max_new = request_prompt(self.seed, self.next_rid, self.model.vocab_size)
            self.pending.append(("add", self.next_rid, prompt, max_new, d))
            self.running[d].append(self.next_rid)
            self.next_rid += 1

    def finish(self, d: int, i: int) -> None:
        if self.running[d]:
            self.pending.append(("finish", self.running[d].pop(i % len(self.running[d]))))

    def preempt(self, d: int, i: int) -> None:
        if self.running[d]:
            rid = self.running[d].pop(i % len(self.running[d]))
            self.pending.append(("preempt", rid))
            self.waiting[d].append(rid)

    def resume(self, d: int) -> None:
        if self.waiting[d] and self.room(d) > 0:
            rid = self.waiting[d].pop(0)
            self.pending.append(("resume", rid))
            self.running[d].append(rid)

    def step(self) -> Verdict:
        cmds, self.pending = self.pending, []
        where = {"layout": self.layout.describe(), "step": self.steps}
        e_rep = self.eager.step(cmds)
        g_rep = self.graph.step(cmds)
        self.steps += 1
        self._check(where, e_rep, g_rep)
        for d in range(self.layout.attn_dp_size):  # natural finishes
            self.running[d] = [r.rid for r in self.eager.running(d)]
        return self.v

    # ---- invariants ----
    def _check(self, where: dict, e_rep, g_rep) -> None:
        v = self.v
        for name, s in (("eager", self.eager), ("graph", self.graph)):
            for e in s.engines:
                v.checked += 1
                for p in e.book.problems(e.sched.running):
                    v.fail("bookkeeping", "KV slots", {**where, "runner": name, "rank": e.ctx.tp_rank}, "consistent", p)
        for d in range(self.layout.attn_dp_size):
            for what, fn in (("running", SpecSession.running), ("waiting", SpecSession.waiting)):
                v.expect_equal("scheduler", what, {**where, "dp_rank": d}, [r.rid for r in fn(self.eager, d)], [r.rid for r in fn(self.graph, d)])
        er, gr = self.eager.requests(), self.graph.requests()
        for d in range(self.layout.attn_dp_size):
            self._compare_draft(where, d, e_rep[d * self.layout.attn_tp_size], g_rep[d * self.layout.attn_tp_size])
        for rid in sorted(er.keys() & gr.keys()):
            if rid in self.diverged:
                continue
            a, b = er[rid], gr[rid]
            w = {**where, "request": rid}
            v.expect_equal("eager-vs-graph", "tokens", w, a.tokens, b.tokens)
            v.expect_equal("eager-vs-graph", "accept_lens", w, a.accept_lens, b.accept_lens)
        self._compare_kv(where, er, gr)
        self._lossless(where, er)

    def _compare_draft(self, where: dict, d: int, e, g) -> None:
        if e.extend_rids != g.extend_rids:
            self.v.expect_equal("eager-vs-graph", "draft-extend batch", {**where, "dp_rank": d}, e.extend_rids, g.extend_rids)
            return
        self._compare_decode(where, d, e, g)
        T = self.spec.num_tokens_per_bs
        for step, (oe, og) in enumerate(zip(e.extend_outs, g.extend_outs, strict=True)):
            for i, rid in enumerate(e.extend_rids):
                if rid in self.diverged:
                    continue
                sl, rq = slice(i * T, (i + 1) * T), slice(i, i + 1)
                pick = lambda o, sl=sl, rq=rq: {"logits": o.logits[sl], "hidden": o.hidden[sl], "logprobs": o.logprobs[rq],  # noqa: E731
                                                "topk_p": o.topk_p[rq], "topk_index": o.topk_index[rq]}
                before = len(self.v.failures)
                same = compare_outputs(self.v, "eager-vs-graph", {**where, "dp_rank": d, "draft_step": step, "request": rid}, pick(oe), pick(og), self.tol)
                if not same and len(self.v.failures) == before:  # a near-tie of the draft: the two runs may now part
                    self.diverged.add(rid)

    def _compare_decode(self, where: dict, d: int, e, g) -> None:
        """The single-layer draft decode's tree of each request (rows in extend_rids order), eager vs graph:
        the structure exactly (a flipped node is another proposal), the probabilities within tolerance."""
        if (e.decode_outs is None) != (g.decode_outs is None):
            self.v.expect_equal("eager-vs-graph", "draft decode ran", {**where, "dp_rank": d}, e.decode_outs is not None, g.decode_outs is not None)
            return
        if e.decode_outs is None:
            return
        te, tg = e.decode_outs.tensors(), g.decode_outs.tensors()
        for i, rid in enumerate(e.extend_rids):
            if rid in self.diverged:
                continue
            w = {**where, "dp_rank": d, "draft": "decode", "request": rid}
            for f in TREE_EXACT:
                self.v.expect_equal("eager-vs-graph", f, w, te[f][i].tolist(), tg[f][i].tolist())
            for f in TREE_CLOSE:
                self.v.checked += 1
                bad = first_bad_row(te[f][i : i + 1], tg[f][i : i + 1], self.tol)
                if bad is not None:
                    self.v.fail("eager-vs-graph", f, w, "match", f"max |diff| {bad[1]:.3g}", f"rtol={self.tol.rtol} atol={self.tol.atol}")

    def _compare_kv(self, where: dict, er, gr) -> None:
        """Live KV at committed positions: draft and target pools, per rank, eager vs graph."""
        for ee, ge in zip(self.eager.engines, self.graph.engines, strict=True):
            for a in ee.sched.running:
                b = next((x for x in ge.sched.running if x.rid == a.rid), None)
                if b is None or not a.has_kv or not b.has_kv or a.rid in self.diverged:
                    continue
                n = min(len(a.tokens), len(b.tokens)) - 1
                sa, sb = a.slots[:n], b.slots[:n]
                pools = [("target", ee.target.kv_pool, ge.target.kv_pool)]
                if getattr(ee.draft, "worker", None) is not None:
                    pools.append(("draft", ee.draft.worker.kv_pool, ge.draft.worker.kv_pool))
                for name, pa, pb in pools:
                    for layer in range(len(pa.k)):
                        for kind, ta, tb in (("k", pa.k[layer], pb.k[layer]), ("v", pa.v[layer], pb.v[layer])):
                            self.v.checked += 1
                            x, y = ta[sa].double(), tb[sb].double()
                            close = torch.isclose(y, x, rtol=self.tol.rtol, atol=self.tol.atol)
                            if not bool(close.all()):
                                pos = int((~close).reshape(n, -1).any(dim=1).nonzero()[0, 0])
                                self.v.fail("eager-vs-graph", f"{name} KV ({kind})",
                                            {**where, "rank": ee.ctx.tp_rank, "request": a.rid, "layer": layer, "position": pos},
                                            "equal within eager-vs-graph tolerance", f"max |diff| {float((x - y).abs().nan_to_num(float('inf')).max()):.3g}",
                                            f"committed position {pos} of request {a.rid}: eager slot {sa[pos]}, graph slot {sb[pos]}")
                                return

    def _lossless(self, where: dict, reqs) -> None:
        new = [r for rid, r in sorted(reqs.items()) if rid not in self._oracle]
        self._oracle.update(oracle(self.eager, new))
        for rid, r in sorted(reqs.items()):
            got, exp = r.tokens[len(r.prompt):], self._oracle[rid]
            self.v.checked += 1
            bad = next((i for i, (a, b) in enumerate(zip(got, exp.tokens, strict=False)) if a != b), None)
            if bad is not None and exp.margins[bad] >= TIE_MARGIN:
                self.v.fail("lossless", "tokens", {**where, "request": rid, "position": bad}, exp.tokens[bad], got[bad],
                            "committed token differs from target-only greedy")

    def finish_check(self) -> Verdict:
        check_loop_replayed(self.v, self.graph, {"layout": self.layout.describe()})
        return self.v


# ---- the probes: fixed churn scripts (each a few seconds on 2 cores) ----

CHURN_SPEC = SpecConfig(num_steps=3, topk=1, capture_bs=(1, 2, 4, 8), max_running_requests=8)
# Fixed schedules crossing every bucket boundary (8 -> 4 -> 2 -> 1 and back) with a preemption;
# (rule, dp_group, arg). The DP one keeps the groups uneven and idles each group once.
CHURN_SCRIPT: tuple[tuple, ...] = (
    ("add", 0, 3), ("step",), ("add", 0, 4), ("step",), ("step",),  # 3 (bucket 4), then 7 (bucket 8)
    ("finish", 0, 0), ("finish", 0, 0), ("step",),  # 5 in bucket 8: padded lanes 5, 6 held requests now at lanes 3, 4
    ("finish", 0, 0), ("finish", 0, 1), ("step",),  # 3 in bucket 4: lane 3 stale, its request alive at lane 1
    ("preempt", 0, 0), ("step",), ("resume", 0), ("add", 0, 3), ("step",),  # 2, then the preempted one back and 6
    ("finish", 0, 1), ("finish", 0, 1), ("finish", 0, 1), ("step",), ("step",),  # 3 in bucket 4 again
    ("finish", 0, 0), ("step",), ("add", 0, 1), ("step",),
)
CHURN_SCRIPT_DP2: tuple[tuple, ...] = (  # two DP groups, uneven, each idle at some point (MLP-TP gather: one bucket for both)
    ("add", 0, 3), ("step",), ("add", 0, 4), ("add", 1, 2), ("step",),
    ("finish", 0, 0), ("finish", 0, 0), ("finish", 1, 0), ("step",),
    ("finish", 0, 0), ("finish", 0, 1), ("add", 1, 2), ("step",),
    ("preempt", 0, 0), ("finish", 1, 0), ("step",), ("resume", 0), ("add", 0, 2), ("step",),
    ("finish", 0, 1), ("finish", 0, 1), ("finish", 1, 0), ("step",), ("finish", 1, 0), ("step",), ("step",),
)
# The single-layer draft (draft-extend, then the graphed draft decode), topk 2: a tree whose lanes the buckets pad.
CHURN_DECODE_SPEC = SpecConfig(num_steps=3, topk=2, capture_bs=(1, 2, 4, 8), max_running_requests=8, draft="single_layer")
# P8 over the EAGLE3 draft at TP1: the default model's two layers, both captured (the embeddings and layer 0's output)
CHURN_EAGLE3_SPEC = SpecConfig(num_steps=3, topk=2, capture_bs=(1, 2, 4, 8), max_running_requests=8, draft="eagle3",
                               eagle_aux_hidden_state_layer_ids=(-1, 0), draft_vocab_size=256)
CHURN_RUNS = ((ParallelLayout(), CHURN_SCRIPT, CHURN_SPEC), (ParallelLayout(tp_size=2, dp_size=2, enable_dp_attention=True), CHURN_SCRIPT_DP2, CHURN_SPEC),
              (ParallelLayout(), CHURN_SCRIPT, CHURN_DECODE_SPEC))


def run_churn_script(layout: ParallelLayout, script: Sequence[tuple], spec: SpecConfig = CHURN_SPEC) -> dict[str, Verdict]:
    try:
        pair = ChurnPair(layout, spec)
        for name, *args in script:
            getattr(pair, name)(*args)
    except RankFailure as err:
        return {RUN: crash_verdict(RUN, {"layout": layout.describe(), "probe": f"{P8} churn"}, err)}
    return {P8: pair.finish_check()}


def _churn_probe(probe_id: str, run: tuple) -> Probe:
    return Probe.guarded(probe_id, lambda: run_churn_script(*run))


# a part per churn run, in CHURN_RUNS' order. The single-layer draft at TP1 (churn-single-layer) replays every runner but
# the multi-layer one (draft-extend, draft decode, verify) eager and graph side by side: one run, for the replay-fill
# mutants (harness.mutants.replay_fill)
CHURN_PROBE_IDS = ("batch-churn:tp1", "batch-churn:tp2_dp2", "churn-single-layer")


PROPERTY = Property(
    P8, "batch churn", Needs.SCHEDULES,
    runs_under="pytest and `harness mutants`",
    probes=(Probe.of("batch-churn", tuple(_churn_probe(pid, run) for pid, run in zip(CHURN_PROBE_IDS, CHURN_RUNS, strict=True))),),
)
