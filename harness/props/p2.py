"""P2 padded lanes: after the replay fill the padded lanes hold canonical values, and poisoning them and every stale
region changes no real row and no live KV. `LanePoison` instruments the draft-extend runners; the loop's other graphed
runners have theirs in harness.props.poison, the hand-built draft-decode replay in harness.props.draft_decode."""
from __future__ import annotations

import torch

from harness.cases.case import Case, load_case
from harness.props.base import Needs, Probe, Property, Verdicts
from harness.props.draft_decode import probe_draft_decode
from harness.props.p1_shapes import check_ragged_gather_index
from harness.props.poison import (
    NAN,
    P2,
    SEQ_SENTINEL,
    DecodePoison,
    RunnerPoison,
    VerifyPoison,
    install_decode_poison,
    install_verify_poison,
)
from harness.ranks.simulated import RankFailure
from harness.run.case_run import RUN, CaseRun
from harness.run.crash import crash_verdict
from harness.run.loop import case_session
from harness.verdict import Verdict
from runners.base_cuda_graph_runner import RunnerKind
from runners.draft_extend import SEQ_LEN_FILL_VALUE, DraftExtendInputs, StepOutputs
from runners.memory import TokenToKVPool
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import (
    MultiLayerEagleDraftExtendCudaGraphRunner,
    OneGraphMultiLayerEagleMultiStepDraftExtendCudaGraphRunner,
)
from runners.spec_decode import SpecEngine

POS_SENTINEL_FROM_END = 1  # positions poisoned to max_context_len - 1: the body indexes req_to_token and the rotary table with them

_RUNNER_BUFFERS = ("input_ids", "positions", "out_cache_loc", "seq_lens", "req_pool_indices", "num_correct_drafts",
                   "num_accept_tokens", "hidden_states", "next_token_logits_buffer")


def _padded_row_rule(r) -> tuple:
    """What a padded lane's req_pool_indices may hold: under vLLM's convention the pad request (-1) and nothing else (no
    row is reserved: any other is a request's); under SGLang's a request row (the padding row, or a stale one P2 proves
    harmless)."""
    if r.worker.req_pool.minus_one:
        return (lambda x: x == r.worker.pad.row), r.worker.pad.row
    return (lambda x: (x >= 0) & (x < r.worker.req_pool.req_to_token.shape[0])), "a request row"


class LanePoison(RunnerPoison):
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

    runner = "draft_extend"
    buffers = _RUNNER_BUFFERS

    def __init__(self, engine: SpecEngine, verdict: Verdict):
        driver = engine.draft.driver
        if driver is None:
            raise ValueError("LanePoison needs the graph runner (runner='graph')")
        # the one-graph composite replays once, at step 0, and serves the later steps from it: poisoning step 0's replay
        # poisons every step's, and each step is compared (`_compare_served`)
        self.one_graph = driver.multi_step if isinstance(driver.multi_step, OneGraphMultiLayerEagleMultiStepDraftExtendCudaGraphRunner) else None
        self.clean_served: list[StepOutputs] = []
        super().__init__(engine, verdict, *(driver.runners[:1] if self.one_graph is not None else driver.runners))

    def _where(self, r: MultiLayerEagleDraftExtendCudaGraphRunner, raw_bs: int, bs: int) -> dict:
        e = self.engine
        return {"layout": e.ctx.layout.describe(), "rank": e.ctx.tp_rank, "engine_step": e.steps, "draft_step": r.step, "raw_bs": raw_bs, "bs": bs}

    def kv_pool(self, r: MultiLayerEagleDraftExtendCudaGraphRunner) -> TokenToKVPool:
        return r.worker.kv_pool

    def after_clean(self, r: MultiLayerEagleDraftExtendCudaGraphRunner, inp: DraftExtendInputs, rec) -> None:
        self._check_canonical(r, inp.bs, rec.bs)
        if r.runner_kind is RunnerKind.RAGGED:
            check_ragged_gather_index(self.v, r.buffers, inp, rec.bs, r.T, self._where(r, inp.bs, rec.bs))
        if self.one_graph is not None:
            self.clean_served = [out.sliced(inp.bs, r.T).cloned() for out in self.one_graph.served[1:]]

    def poison(self, r: MultiLayerEagleDraftExtendCudaGraphRunner, raw_bs: int) -> None:
        self._poison(r, raw_bs)

    def compare(self, r: MultiLayerEagleDraftExtendCudaGraphRunner, raw_bs: int, bs: int, clean, poisoned, s1: dict) -> None:
        self._compare(r, raw_bs, bs, clean, poisoned, s1)
        if self.one_graph is not None:
            self._compare_served(raw_bs, bs, s1)

    def _compare_served(self, raw_bs: int, bs: int, s1: dict) -> None:
        """The later steps of the poisoned one-graph replay against the clean one's; then the clean outputs are put back
        where the composite serves them from, so the loop continues with the clean run."""
        for r, clean, out in zip(self.one_graph.runners[1:], self.clean_served, self.one_graph.served[1:], strict=True):
            served = out.sliced(raw_bs, r.T)
            self._compare(r, raw_bs, bs, clean, served, s1)
            for name, t in served.tensors().items():
                t.copy_(getattr(clean, name))

    def _check_canonical(self, r, raw_bs: int, bs: int) -> None:
        T, w = r.T, self._where(r, raw_bs, bs)
        raw_n = raw_bs * T
        if r.runner_kind is RunnerKind.SINGLE_LAYER and bs == raw_bs:
            self._check_gathered(r, bs, w)  # the single-layer fill resets nothing without padding, as the engine's
            return
        if r.runner_kind is RunnerKind.PIECEWISE:
            self._check_gathered(r, bs, w)  # PIECEWISE pads no request (vLLM): padded lanes stay stale, the poison below proves it harmless
            return
        # the one graph writes the chain into every lane of the bucket as it runs: its fill is read from before the replay
        filled = self.before_replay["buf"] if self.one_graph is not None else {name: getattr(r, name) for name in self.buffers}
        for name, want in (("input_ids", 0), ("positions", 0), ("out_cache_loc", r.worker.pad.slot)):
            tail = filled[name][raw_n:]
            self.v.checked += 1
            bad = (tail != want).nonzero()
            if bad.numel():
                row = raw_n + int(bad[0, 0])
                self.v.fail("canonical", name, {**w, "row": row}, want, int(tail[bad[0, 0]]),
                            f"padded token row {row} (lane {row // T}) after the replay fill")
        lanes = (("seq_lens", lambda x: x == SEQ_LEN_FILL_VALUE, SEQ_LEN_FILL_VALUE),
                 ("num_correct_drafts", lambda x: (x >= 0) & (x < T), f"in [0, {T - 1}]"),
                 ("num_accept_tokens", lambda x: (x >= 1) & (x <= T), f"in [1, {T}]"),
                 ("req_pool_indices", *_padded_row_rule(r)))
        for name, ok, want in lanes:
            tail = filled[name][raw_bs:bs] if name != "seq_lens" else filled[name][raw_bs:]
            self.v.checked += 1
            bad = (~ok(tail)).nonzero()
            if bad.numel():
                lane = raw_bs + int(bad[0, 0])
                self.v.fail("canonical", name, {**w, "lane": lane}, want, int(tail[bad[0, 0]]), f"padded lane {lane} after the replay fill")
        self._check_gathered(r, bs, w)

    def _check_gathered(self, r, bs: int, w: dict) -> None:
        if r.global_num_tokens_gpu is not None:
            self.v.expect_equal("canonical", "global_num_tokens_gpu (replay fill)", w, [bs * r.T] * r.global_num_tokens_gpu.shape[0],
                                r.global_num_tokens_gpu.tolist())

    def _poison(self, r, raw_bs: int) -> None:
        T, w = r.T, r.worker
        raw_n = raw_bs * T
        poison_slot = self.poison_stale(r)
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
        live_slots, _, _ = self.live()
        if not live_slots:
            return
        kv, n = r.worker.kv_pool, len(r.worker.kv_pool.k)  # the snapshot holds k + v
        for name, now, ref in (("draft KV (k)", kv.k, s1["kv"][:n]), ("draft KV (v)", kv.v, s1["kv"][n:])):
            for layer, (a, b) in enumerate(zip(now, ref, strict=True)):
                self.v.checked += 1
                if not torch.equal(a[live_slots], b[live_slots]):
                    bad = (a[live_slots] != b[live_slots]).reshape(len(live_slots), -1).any(dim=1).nonzero()
                    slot = live_slots[int(bad[0, 0])]
                    self.v.fail("poison", name, {**w, "layer": layer, "slot": slot}, "bit-identical live KV", "differs",
                                f"live slot {slot} (layer {layer}) was written differently when the padded lanes were poisoned")
                    return


def check_padded_lanes(case: Case, rounds_per_phase: int = 2, device: str = "cpu") -> Verdicts:
    poisons: list[LanePoison] = []  # one per rank, each with its own verdict (ranks are threads)
    verify: list[VerifyPoison] = []  # the TARGET_VERIFY runner's, likewise
    decode: list[DecodePoison] = []  # the single-layer draft's draft-decode runner's, likewise
    where, crash = {"case": case.name, "layout": case.layout.describe()}, {}
    hook = lambda e: (getattr(e.draft, "worker", None) is not None and poisons.append(LanePoison(e, Verdict(P2))),  # noqa: E731 (a rank may hold no draft)
                      install_verify_poison(verify)(e),
                      install_decode_poison(decode)(e))
    try:
        case_session(case, "graph", hook=hook, rounds_per_phase=rounds_per_phase, device=device)
    except RankFailure as err:
        crash = {RUN: crash_verdict(RUN, where, err)}
    v = Verdict(P2)
    for p in sorted(poisons + verify + decode, key=lambda p: p.engine.ctx.tp_rank):
        v.merge(p.v)
    if crash:
        return {P2: v, **crash}
    for what, ps in (("draft-extend", poisons), ("target verify", verify), *((("draft decode", decode),) if decode else ())):
        v.checked += 1
        if not any(p.replays for p in ps):
            v.fail("replayed", f"{what} graph replays", where, "> 0", 0, f"no {what} replayed a graph: nothing was checked")
    return {P2: v}


def check(run: CaseRun) -> Verdicts:
    return check_padded_lanes(run.case)


# ---- probes (each a few seconds on 2 cores) ----

PAD_MINUS_ONE_CASE = "tp2_dp2_pad_minus_one"  # vLLM's padding convention (SpecConfig.padding_convention)
TRITON_CASE = "tp1_triton_shrink"  # the Triton backend: its kernels (in the interpreter on CPU) read the padded lanes


def _lanes_probe(probe_id: str, case: str) -> Probe:
    return Probe.guarded(probe_id, lambda: check_padded_lanes(load_case(case)))


# one run each, for the replay-fill mutants (harness.mutants.replay_fill): P2 on a shrinking case checks the canonical
# fill of the padded lanes of its draft-extend and verify runners, so a mutant per fill line stays cheap
MULTI_LAYER_LANES = _lanes_probe("padded-lanes-multi-layer", "tp2_shrink")
SINGLE_LAYER_LANES = _lanes_probe("padded-lanes-single-layer", "tp2_single_layer_shrink")


PROPERTY = Property(
    P2, "padded lanes", Needs.LOOP, check,
    probes=(
        # P2 over four cases, a part each (the last: the draft-decode runner at TP2)
        Probe.of("padded-lanes", (MULTI_LAYER_LANES, *(_lanes_probe(f"padded-lanes:{name}", name) for name in ("tp4_dp2_mlp_tp_gather", "tp2_page4_tree")),
                                  SINGLE_LAYER_LANES)),
        # the single-layer draft decode: P1 on every layout, P2 on poisoned padded lanes, P1 / P3 / P6 over its cases
        probe_draft_decode,
        # vLLM's padding convention: a pad request -1 whose KV writes are skipped (its case: DP2, eager MLP-sync padding)
        _lanes_probe("padded-lanes-pad-minus-one", PAD_MINUS_ONE_CASE),
        # the torch-backend probes never reach a kernel of the other backends: the poison inside the Triton kernels
        _lanes_probe("padded-lanes-triton", TRITON_CASE),
    ),
)
