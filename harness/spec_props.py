"""P2, P5, P6 and P8 over the speculative decoding loop (runners.spec_decode), as Verdicts.

* P5 lossless: every request's committed tokens equal target-only greedy decoding (TP1,
  the same weights), token for token, on every layout and runner; and a draft that shares
  the target's weights (`proposer="target"`) accepts every token of every round.
* P6 acceptance: per request, the accept length of every verify round and the accept count
  of every draft position equal the case's golden (golden/acceptance/<case>.json), exactly.
* P2 padded lanes: around every graph replay of every draft step and of the verify, (a) after the replay fill
  the padded lanes hold the canonical values, and (b) a second replay from the same state
  with the padded lanes and every stale region poisoned gives bit-identical real rows and
  live KV, with no poisoned value in a real row.
* P8 batch churn: eager and graph engines side by side under adds, finishes, preemptions
  and resumes across bucket boundaries; after every step the KV bookkeeping, the scheduler
  state, the tokens, accept lengths, draft outputs and the live KV of both agree, and the
  output is lossless. `ChurnPair` is the state; tests/test_batch_churn.py drives it with a
  hypothesis RuleBasedStateMachine, `probe_churn` with a fixed script.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from harness import verify_props
from harness.case import Case, load_case
from harness.checks import crash_detail, crash_name
from harness.props.outputs import compare_outputs
from harness.ranks.simulated import RankFailure
from harness.spec_decode import (
    DEFAULT_MODEL,
    AcceptanceGoldenError,
    SpecSession,
    Workload,
    acceptance_stats,
    case_session,
    load_acceptance_golden,
    oracle,
    request_prompt,
    run_workload,
)
from harness.tolerances import eager_vs_graph
from harness.verdict import Verdict, merge_verdicts
from runners.config import ModelConfig, SpecConfig
from runners.cuda_graph import EagleDraftExtendCudaGraphRunnerBase
from runners.draft_extend import SEQ_LEN_FILL_VALUE, DraftExtendInputs, StepOutputs
from runners.memory import PADDING_SLOT
from runners.parallel.layout import ParallelLayout
from runners.spec_decode import SpecEngine

# A greedy token whose top-2 target logits are closer than this may flip between two correct
# computations (fp32 sums reordered by another batch shape or TP shard: measured <= 2.4e-6 on
# logits of magnitude ~3, harness/tolerances.py). A mismatch there is a tie, noted, not a failure.
TIE_MARGIN = 1e-4


def _crash(prop: str, where: dict, err: BaseException) -> Verdict:
    v = Verdict(prop)
    v.fail("run", "ranks", where, "every rank completes", crash_name(err), crash_detail(err))
    return v


# ----------------------------------------------------------------------------------------
# P5 lossless
# ----------------------------------------------------------------------------------------


def check_lossless(session: SpecSession, where: dict) -> Verdict:
    v = Verdict("P5")
    reqs = session.requests()
    ref = oracle(session, sorted(reqs.values(), key=lambda r: r.rid))
    full = min(session.spec.num_steps, session.spec.num_tokens_per_bs - 1) + 1  # the top-1 chain's depth in the tree, + the bonus
    for rid, r in sorted(reqs.items()):
        got, exp = r.tokens[len(r.prompt):], ref[rid]
        w = {**where, "request": rid}
        v.checked += 1
        if len(got) > r.max_new_tokens:
            v.fail("lossless", "length", w, f"<= {r.max_new_tokens}", len(got), "committed past the token budget")
        bad = next((i for i, (a, b) in enumerate(zip(got, exp.tokens, strict=False)) if a != b), None)
        if bad is not None:
            if exp.margins[bad] < TIE_MARGIN:
                v.notes.append(f"P5 {w}: output token {bad} is a near-tie of the target (margin {exp.margins[bad]:.2g}); not compared further")
            else:
                v.fail("lossless", "tokens", {**w, "position": bad}, exp.tokens[bad : bad + 4], got[bad : bad + 4],
                       f"output token {bad} differs from target-only greedy (margin {exp.margins[bad]:.3g})")
        if session.proposer == "target":
            for k, a in enumerate(r.accept_lens):
                v.checked += 1
                if a != full:
                    v.fail("accept-all", "accept_len", {**w, "round": k}, full, a, "a draft that equals the target must accept its whole chain")
                    break
    return v


# ----------------------------------------------------------------------------------------
# P6 acceptance goldens
# ----------------------------------------------------------------------------------------


def compare_acceptance(v: Verdict, golden: dict, session: SpecSession, where: dict) -> None:
    got, exp = acceptance_stats(session)["requests"], golden["requests"]
    S = session.spec.num_steps
    v.checked += 1
    if set(got) != set(exp):
        v.fail("golden", "requests", where, sorted(exp, key=int), sorted(got, key=int),
               "other requests ran (the workload replaces the requests that finish, so acceptance changed who finished when)")
    for rid in sorted(set(got) & set(exp), key=int):
        g, e = got[rid], exp[rid]
        v.checked += 1
        if g["accept_lens"] == e["accept_lens"] and g["position_accepts"] == e["position_accepts"]:
            continue
        changed = [k + 1 for k in range(S) if g["position_accepts"][k] != e["position_accepts"][k]]
        rnd = next((i for i, (a, b) in enumerate(zip(g["accept_lens"], e["accept_lens"], strict=False)) if a != b), min(len(g["accept_lens"]), len(e["accept_lens"])))
        ga = g["accept_lens"][rnd] if rnd < len(g["accept_lens"]) else "-"
        ea = e["accept_lens"][rnd] if rnd < len(e["accept_lens"]) else "-"
        v.fail("golden", "position_accepts", {**where, "request": int(rid)}, e["position_accepts"], g["position_accepts"],
               f"draft positions {changed or 'none'} changed; accept lengths first differ at verify round {rnd} (golden {ea}, got {ga})")


def check_spec_case(case: Case, runners: Sequence[str] = ("eager", "graph"), props: Sequence[str] = ("P5", "P6")) -> dict[str, Verdict]:
    """P5 and P6 on one case's workload, one run per runner; the graph run also gives the
    TARGET_VERIFY runner's P3 and P1 (harness.verify_props)."""
    out = {p: Verdict(p) for p in props}
    golden = None
    if "P6" in props:
        try:
            golden = load_acceptance_golden(case)
        except AcceptanceGoldenError as e:
            out["P6"].fail("golden", "file", {"case": case.name}, "a golden for this case", "none usable", str(e))
    for runner in runners:
        where = {"case": case.name, "layout": case.layout.describe(), "runner": runner}
        shadows: list[verify_props.VerifyShadow] = []  # graph: P3 / P1 on every TARGET_VERIFY replay
        try:
            s = case_session(case, runner, hook=verify_props.install(shadows) if runner == "graph" else None)
        except RankFailure as err:
            out["run"] = out.get("run", Verdict("run")).merge(_crash("run", where, err))
            continue
        if runner == "graph":
            merge_verdicts(out, verify_props.shadow_verdicts(shadows, where))
        if "P5" in props:
            out["P5"].merge(check_lossless(s, where))
        if golden is not None:
            compare_acceptance(out["P6"], golden, s, where)
    return out


def check_acceptance_case(case: Case) -> Verdict:
    """P6 alone; a run that crashed is a failure of the result, never an empty pass."""
    out = check_spec_case(case, props=("P6",))
    v = out["P6"]
    if "run" in out:
        v.merge(out["run"])
    return v


def check_agreeing_draft(layout: ParallelLayout, spec: SpecConfig, wl: Workload, model: ModelConfig = DEFAULT_MODEL) -> dict[str, Verdict]:
    """P5's positive control: the target's own weights as the draft accept every token."""
    where = {"layout": layout.describe(), "proposer": "target", "topk": spec.topk}
    try:
        s = run_workload(SpecSession(layout, spec, model, proposer="target"), wl)
    except RankFailure as err:
        return {"run": _crash("run", where, err)}
    return {"P5": check_lossless(s, where)}


# ----------------------------------------------------------------------------------------
# P2 padded lanes: canonical values after the replay fill; poisoned replays change nothing real
# ----------------------------------------------------------------------------------------

NAN = float("nan")
POS_SENTINEL_FROM_END = 1  # positions poisoned to max_context_len - 1: the body indexes req_to_token and the rotary table with them
SEQ_SENTINEL = 1 << 30  # seq_lens poisoned far out of range (a mask bound only)

_RUNNER_BUFFERS = ("input_ids", "positions", "out_cache_loc", "seq_lens", "req_pool_indices", "num_correct_drafts",
                   "num_accept_tokens", "hidden_states", "next_token_logits_buffer")


class LanePoison:
    """Instruments one engine's graph runners (P2). Every replay runs twice from the same state:
    clean (then the padded lanes are checked against the canonical fill), and with the padded
    lanes and stale regions poisoned; real rows and live KV must be bit-identical. The clean
    run's state is what the loop continues with.

    Poison, per buffer: float buffers NaN (hidden_states of padded and unused rows, the whole
    logits output buffer; every KV slot no live request owns, the padding slot included).
    Index buffers only computed with get out-of-range sentinels (seq_lens, num_accept_tokens).
    Index buffers the body dereferences get an in-bounds sentinel that points at poisoned
    memory (out_cache_loc: a non-live slot; req_pool_indices: row 0, whose entries, like those
    of every non-live row and the tail of every live row, point at a non-live slot; positions:
    the last row of req_to_token and of the rotary table; input_ids: vocab_size - 1, the
    embedding cannot be poisoned). The step
    body selects with num_correct_drafts and writes next_input_ids at those rows, so padded
    lanes get stale but in-domain values [0, T-1]: what the engine can leave there.
    """

    def __init__(self, engine: SpecEngine, verdict: Verdict):
        self.engine, self.v = engine, verdict
        self.replays = 0
        driver = engine.draft.driver
        if driver is None:
            raise ValueError("LanePoison needs the graph runner (runner='graph')")
        for r in driver.runners:
            r.replay = self._wrap(r, r.replay)

    def _where(self, r: EagleDraftExtendCudaGraphRunnerBase, raw_bs: int, bs: int) -> dict:
        e = self.engine
        return {"layout": e.ctx.layout.describe(), "rank": e.ctx.tp_rank, "engine_step": e.steps, "draft_step": r.step, "raw_bs": raw_bs, "bs": bs}

    def _live(self) -> tuple[list[int], list[int], list[int]]:
        reqs = [q for q in self.engine.sched.running if q.has_kv]
        return [s for q in reqs for s in q.slots], [q.req_pool_idx for q in reqs], [len(q.slots) for q in reqs]

    def _snap(self, r) -> dict:
        w = r.worker
        return {"buf": {b: getattr(r, b).clone() for b in _RUNNER_BUFFERS},
                "k": [t.clone() for t in w.kv_pool.k], "v": [t.clone() for t in w.kv_pool.v], "rows": w.req_pool.req_to_token.clone()}

    def _restore(self, r, snap: dict) -> None:
        w = r.worker
        for b, t in snap["buf"].items():
            getattr(r, b).copy_(t)
        for dst, src in zip(w.kv_pool.k + w.kv_pool.v, snap["k"] + snap["v"], strict=True):
            dst.copy_(src)
        w.req_pool.req_to_token.copy_(snap["rows"])

    def _wrap(self, r: EagleDraftExtendCudaGraphRunnerBase, replay: Callable):
        def poisoned_replay(inp: DraftExtendInputs, record: bool = True):
            s0 = self._snap(r)  # P2 needs the records (the bucket) whatever the driver asked for
            out_c, rec_c = replay(inp)
            self._check_canonical(r, inp.bs, rec_c.bs)
            s1 = self._snap(r)
            self._restore(r, s0)
            self._poison(r, inp.bs)
            out_p, _ = replay(inp)
            self._compare(r, inp.bs, rec_c.bs, out_c, out_p, s1)
            self._restore(r, s1)
            self.replays += 1
            return out_c, rec_c if record else None

        return poisoned_replay

    def _check_canonical(self, r, raw_bs: int, bs: int) -> None:
        T, w = r.T, self._where(r, raw_bs, bs)
        raw_n = raw_bs * T
        for name, want in (("input_ids", 0), ("positions", 0), ("out_cache_loc", PADDING_SLOT)):
            tail = getattr(r, name)[raw_n:]
            self.v.checked += 1
            bad = (tail != want).nonzero()
            if bad.numel():
                row = raw_n + int(bad[0, 0])
                self.v.fail("canonical", name, {**w, "row": row}, want, int(tail[bad[0, 0]]),
                            f"padded token row {row} (lane {row // T}) after the replay fill")
        lanes = (("seq_lens", lambda x: x == SEQ_LEN_FILL_VALUE, SEQ_LEN_FILL_VALUE),
                 ("num_correct_drafts", lambda x: (x >= 0) & (x < T), f"in [0, {T - 1}]"),
                 ("num_accept_tokens", lambda x: (x >= 1) & (x <= T), f"in [1, {T}]"),
                 ("req_pool_indices", lambda x: (x >= 0) & (x < r.worker.req_pool.req_to_token.shape[0]), "a request row"))
        for name, ok, want in lanes:
            tail = getattr(r, name)[raw_bs:bs] if name != "seq_lens" else getattr(r, name)[raw_bs:]
            self.v.checked += 1
            bad = (~ok(tail)).nonzero()
            if bad.numel():
                lane = raw_bs + int(bad[0, 0])
                self.v.fail("canonical", name, {**w, "lane": lane}, want, int(tail[bad[0, 0]]), f"padded lane {lane} after the replay fill")
        if r.global_num_tokens_gpu is not None:
            self.v.expect_equal("canonical", "global_num_tokens_gpu (replay fill)", w, [bs * T] * r.global_num_tokens_gpu.shape[0],
                                r.global_num_tokens_gpu.tolist())

    def _poison(self, r, raw_bs: int) -> None:
        T, w = r.T, r.worker
        raw_n = raw_bs * T
        live_slots, live_rows, live_lens = self._live()
        num_slots = w.kv_pool.k[0].shape[0]
        dead = torch.ones(num_slots, dtype=torch.bool)
        dead[live_slots] = False
        poison_slot = int(dead.nonzero().max())
        for t in w.kv_pool.k + w.kv_pool.v:
            t[dead] = NAN
        rows = w.req_pool.req_to_token
        keep = rows.clone()
        rows.fill_(poison_slot)
        for idx, n in zip(live_rows, live_lens, strict=True):
            rows[idx, :n] = keep[idx, :n]
        r.hidden_states[raw_n:] = NAN
        r.next_token_logits_buffer.fill_(NAN)
        r.input_ids[raw_n:] = w.cfg.vocab_size - 1
        r.positions[raw_n:] = w.cfg.max_context_len - POS_SENTINEL_FROM_END
        r.out_cache_loc[raw_n:] = poison_slot
        r.seq_lens[raw_bs:] = SEQ_SENTINEL
        r.req_pool_indices[raw_bs:] = 0
        lanes = torch.arange(raw_bs, r.max_bs)
        r.num_correct_drafts[raw_bs:] = (lanes * 3 + 1) % T
        r.num_accept_tokens[raw_bs:] = -1

    def _compare(self, r, raw_bs: int, bs: int, clean: StepOutputs, poisoned: StepOutputs, s1: dict) -> None:
        w = self._where(r, raw_bs, bs)
        T = r.T
        for name, t_c in clean.tensors().items():
            t_p = getattr(poisoned, name)
            self.v.checked += 1
            if torch.equal(t_c, t_p):
                continue
            if t_c.dim() == 0:
                self.v.fail("poison", name, w, int(t_c), int(t_p), "changed by poisoning the padded lanes")
                continue
            diff = (t_c != t_p).reshape(t_c.shape[0], -1).any(dim=1).nonzero()
            row = int(diff[0, 0])
            unit = f"token row {row} (request lane {row // T})" if t_c.shape[0] == raw_bs * T else f"request lane {row}"
            nan = bool(t_p[row].isnan().any()) if t_p.is_floating_point() else False
            self.v.fail("poison", name, {**w, "row": row}, "bit-identical to the clean replay", "NaN (a poisoned value)" if nan else "differs",
                        f"real {unit} {'read a poisoned value' if nan else 'changed'} when the padded lanes and stale regions were poisoned")
        live_slots, _, _ = self._live()
        if not live_slots:
            return
        for name, now, ref in (("draft KV (k)", r.worker.kv_pool.k, s1["k"]), ("draft KV (v)", r.worker.kv_pool.v, s1["v"])):
            for layer, (a, b) in enumerate(zip(now, ref, strict=True)):
                self.v.checked += 1
                if not torch.equal(a[live_slots], b[live_slots]):
                    bad = (a[live_slots] != b[live_slots]).reshape(len(live_slots), -1).any(dim=1).nonzero()
                    slot = live_slots[int(bad[0, 0])]
                    self.v.fail("poison", name, {**w, "layer": layer, "slot": slot}, "bit-identical live KV", "differs",
                                f"live slot {slot} (layer {layer}) was written differently when the padded lanes were poisoned")
                    return


def check_padded_lanes(case: Case, rounds_per_phase: int = 2) -> dict[str, Verdict]:
    poisons: list[LanePoison] = []  # one per rank, each with its own verdict (ranks are threads)
    verify: list[verify_props.VerifyPoison] = []  # the TARGET_VERIFY runner's, likewise
    where, crash = {"case": case.name, "layout": case.layout.describe()}, {}
    hook = lambda e: (poisons.append(LanePoison(e, Verdict("P2"))), verify_props.install_poison(verify)(e))  # noqa: E731
    try:
        case_session(case, "graph", hook=hook, rounds_per_phase=rounds_per_phase)
    except RankFailure as err:
        crash = {"run": _crash("run", where, err)}
    v = Verdict("P2")
    for p in sorted(poisons + verify, key=lambda p: p.engine.ctx.tp_rank):
        v.merge(p.v)
    if crash:
        return {"P2": v, **crash}
    for what, ps in (("draft-extend", poisons), ("target verify", verify)):
        v.checked += 1
        if not any(p.replays for p in ps):
            v.fail("replayed", f"{what} graph replays", where, "> 0", 0, f"no {what} replayed a graph: nothing was checked")
    return {"P2": v}


# ----------------------------------------------------------------------------------------
# P8 batch churn: eager and graph side by side
# ----------------------------------------------------------------------------------------


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
        self.v = Verdict("P8")
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
        T = self.spec.num_tokens_per_bs
        for step, (oe, og) in enumerate(zip(e.extend_outs, g.extend_outs, strict=True)):
            for i, rid in enumerate(e.extend_rids):
                if rid in self.diverged:
                    continue
                sl, rq = slice(i * T, (i + 1) * T), slice(i, i + 1)
                pick = lambda o, sl=sl, rq=rq: {"logits": o.logits[sl], "hidden": o.hidden[sl], "logprobs": o.logprobs[rq], "topk_p": o.topk_p[rq], "topk_index": o.topk_index[rq]}  # noqa: E731
                before = len(self.v.failures)
                same = compare_outputs(self.v, "eager-vs-graph", {**where, "dp_rank": d, "draft_step": step, "request": rid}, pick(oe), pick(og), self.tol)
                if not same and len(self.v.failures) == before:  # a near-tie of the draft: the two runs may now part
                    self.diverged.add(rid)

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
                if hasattr(ee.draft, "worker"):
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
        replays = sum(e.draft.driver.stats.replays for e in self.graph.engines)
        self.v.expect_equal("replayed", "graph replays > 0", {"layout": self.layout.describe()}, True, replays > 0)
        verify = sum(e.verify_graph.backend.stats.replays for e in self.graph.engines)
        self.v.expect_equal("replayed", "target verify replays > 0", {"layout": self.layout.describe()}, True, verify > 0)
        return self.v


# ----------------------------------------------------------------------------------------
# probes for `harness mutants` (each a few seconds on 2 cores)
# ----------------------------------------------------------------------------------------

PROBE_SPEC_CASES = ("tp1_neither", "tp4_attn_tp_gather", "tp4_neither_topk2", "tp2_page4_shrink", "tp2_page4_tree")
P2_CASES = ("tp2_shrink", "tp4_dp2_mlp_tp_gather", "tp2_page4_tree")
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
CHURN_RUNS = ((ParallelLayout(), CHURN_SCRIPT), (ParallelLayout(tp_size=2, dp_size=2, enable_dp_attention=True), CHURN_SCRIPT_DP2))


def run_churn_script(layout: ParallelLayout, script: Sequence[tuple], spec: SpecConfig = CHURN_SPEC) -> dict[str, Verdict]:
    try:
        pair = ChurnPair(layout, spec)
        for name, *args in script:
            getattr(pair, name)(*args)
    except RankFailure as err:
        return {"run": _crash("run", {"layout": layout.describe(), "probe": "P8 churn"}, err)}
    return {"P8": pair.finish_check()}


def _guarded(name: str, fn: Callable[[], dict[str, Verdict]]) -> Callable[[], dict[str, Verdict]]:
    """A probe never raises: an exception anywhere (a rank, the oracle, the harness) is a "run" failure."""

    def probe() -> dict[str, Verdict]:
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - reported, never swallowed
            return {"run": _crash("run", {"probe": name}, err)}

    probe.__name__ = f"probe_{name.replace('-', '_')}"
    return probe


AGREE_RUNS = (  # P5's positive control: plain TP (tree with topk 2) and an MLP-TP-gather DP layout
    (ParallelLayout(tp_size=2), SpecConfig(num_steps=2, topk=2, capture_bs=(1, 2, 4, 8), max_running_requests=8), Workload(((3,), (5,), (2,)), 2)),
    (ParallelLayout(tp_size=2, dp_size=2, enable_dp_attention=True), SpecConfig(num_steps=3, topk=1, capture_bs=(1, 2, 4, 8), max_running_requests=8),
     Workload(((2, 1), (3, 0), (1, 2)), 2)),
)


def _spec_cases() -> dict[str, Verdict]:
    """P5 and P6 (graph runner) over the probe cases; the agreeing draft (P5) on two layouts."""
    out: dict[str, Verdict] = {}
    for name in PROBE_SPEC_CASES:
        merge_verdicts(out, check_spec_case(load_case(name), runners=("graph",)))
    for layout, spec, wl in AGREE_RUNS:
        merge_verdicts(out, check_agreeing_draft(layout, spec, wl))
    return out


def _padded_lanes() -> dict[str, Verdict]:
    out: dict[str, Verdict] = {}
    for name in P2_CASES:
        merge_verdicts(out, check_padded_lanes(load_case(name)))
    return out


def _churn() -> dict[str, Verdict]:
    out: dict[str, Verdict] = {}
    for layout, script in CHURN_RUNS:
        merge_verdicts(out, run_churn_script(layout, script))
    return out


probe_spec_cases = _guarded("spec-cases", _spec_cases)
probe_padded_lanes = _guarded("padded-lanes", _padded_lanes)
probe_churn = _guarded("batch-churn", _churn)

SPEC_PROBES = (("spec-cases", probe_spec_cases), ("padded-lanes", probe_padded_lanes), ("batch-churn", probe_churn))


def register_spec_probes(register: Callable[[str, Callable[[], dict[str, Verdict]]], None]) -> None:
    for name, probe in SPEC_PROBES:
        register(name, probe)

