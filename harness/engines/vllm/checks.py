"""Our invariants on what vLLM's EAGLE proposer captured and replayed (drive.py's records).

Per DP world and runner (the target's uniform-decode graphs, whose DP agreement the proposer
reuses; the draft prefill graphs at 1 + K tokens per request; the draft decode graphs at one):

* capture sizes: every uniform-decode graph holds q tokens per request (q = 1 + K for the
  target and the draft prefill, 1 for draft decode), num_tokens = num_reqs * q, within
  max_num_seqs and the token cap; the captured request counts and PIECEWISE token sizes follow
  the release's own rule (api.py: request-keyed from 0.34, token-keyed before).
* capture = replay (I1): a replayed graph's bake (num_tokens, num_tokens_across_dp of its
  capture pass) equals what the replay agreed; every bake holds [num_tokens] * dp.
* DP padding: every rank of an iteration runs the same mode and token count; with graphs,
  num_tokens_across_dp is that count on every rank; the graph is the one the release's own
  dispatch order picks for the largest rank's batch (api.DispatchOrder: from 0.29 the smallest
  FULL graph holding its requests, else the smallest PIECEWISE one holding its tokens; before,
  the smallest captured token count whatever its mode), eager exactly when none holds it.
* lanes and padded tail (draft decode, what every draft step's forward reads: after
  _prepare_decode_inputs, then after the step before, with compute_slot_mappings on the host
  for the per-step loop, inside the replayed graph for the fused one): real lanes hold the live
  batch advanced by the steps before (the id each sampled, positions and seq_lens one further
  per step, their KV slots); padded lanes [raw, bs) are canonical (query_start_loc = raw:
  zero-length queries; seq_lens = 0 at step 1, advanced with the steps by the graph's update
  over its captured requests; slot_mapping = PAD_SLOT_ID) and independent of the history (the
  schedule replays each size after smaller and after larger batches). input_ids / positions of padded lanes are left as the last larger
  batch wrote them by design: reported as n/a with the lanes, never as a pass.
* steps and metadata (both draft decode paths): a fused graph bakes all K - 1 draft steps, a
  per-step graph one; propose() runs steps 1 .. K - 1; each step's forward runs on attention
  metadata derived (built on the host, or updated in place inside the fused graph) from the
  query_start_loc and seq_lens it reads, over its padded request count.
"""
from __future__ import annotations

from typing import Any, Optional

from harness.engines.vllm.api import SMALLEST_LARGEST, CaptureApi, DispatchOrder
from harness.engines.vllm.config import VllmCheckConfig
from harness.engines.vllm.drive import DECODE_RUNNERS, KV_BLOCK_SIZE, RankCapture, VllmReplay
from harness.engines.vllm.report import VLine
from harness.verdict import Verdict

PAD_SLOT_ID = -1  # vllm.v1.attention.backends.utils: a slot the KV write skips

NOT_APPLICABLE = (
    "I2/I4/I5 (for-logprob counts, rows fed to lm_head, the gathered DP buffer): n/a: vLLM's proposer has no "
    "global_num_tokens_for_logprob and no logits buffer sized from DP token counts; each draft step samples one row "
    "per request (last_token_indices)",
    "I3 (MLP-TP vs attn-TP gather branch parity): n/a: vLLM pads DP through one path (dispatch_cg_and_sync_dp), "
    "there are no gather branches",
    "I6 (single- vs multi-layer draft-extend runner): n/a: one proposer, with a prefill and a decode graph manager",
    "target_verify I1 (bake): n/a: the target's graphs are captured with the model by ModelCudaGraphManager, not driven "
    "here; its DP agreement, which the proposer reuses, is checked",
    "draft_decode_fused graphs keyed by step count (specialize_spec_tokens): n/a: only under dynamic speculative decoding "
    "(per-batch-size K), off in the configuration driven; each fused graph's baked steps are checked against K - 1",
)


def query_len(runner: str, cfg: VllmCheckConfig) -> int:
    return 1 if runner in DECODE_RUNNERS else 1 + cfg.num_speculative_tokens


def rule_runner(runner: str) -> str:
    """The runner whose capture rules apply (api.py): both draft decode paths share the decode manager's."""
    return DECODE_RUNNERS[0] if runner in DECODE_RUNNERS else runner


def check_capture(ln: VLine, runner: str, cap: RankCapture, cfg: VllmCheckConfig, dp: int, rank: int, api: CaptureApi, vcfg: Any) -> None:
    """The release's capture-size rules (api.py, per capture API) against what this rank captured."""
    v, q = ln.verdict, query_len(runner, cfg)
    cap_tokens = api.max_capture_tokens(cfg)
    full = [(d, g) for d, g in cap.graphs[runner] if d.cg_mode.name == "FULL"]
    reqs = [d.num_reqs for d, _ in full]
    ln.ranks.add(rank)
    ln.captured = reqs
    for d, g in full:
        w = {"dp": dp, "rank": rank, "runner": runner, "num_reqs": d.num_reqs}
        v.expect_equal("capture sizes", "uniform_token_count", w, q, d.uniform_token_count,
                       f"1 + K for the target (its manager's query length: {api.query_len_reason()}) and the draft prefill, "
                       "1 for draft decode" if runner == "target_verify" else "1 + K for verify-width graphs, 1 for draft decode")
        v.expect_equal("capture sizes", "num_tokens", w, d.num_reqs * q, d.num_tokens, "num_reqs * q")
        v.expect_equal("capture sizes", "num_reqs <= max_num_seqs", w, True, d.num_reqs <= cfg.max_num_seqs)
        v.expect_equal("capture sizes", "num_tokens <= cap", w, True, d.num_tokens <= cap_tokens, f"max_cudagraph_capture_size {cap_tokens}")
        if runner == "target_verify":
            continue  # the bake is the adapter's own capture pass (NOT_APPLICABLE)
        if not v.expect_equal("I1", "captured", w, True, g.baked is not None, "the capture pass ran the forward inside the graph"):
            continue
        v.expect_equal("I1", "baked num_tokens", w, d.num_tokens, g.baked["num_tokens"])
        v.expect_equal("I1", "baked num_tokens_across_dp", w, [d.num_tokens] * dp if dp > 1 else None, g.baked["num_tokens_across_dp"],
                       "every DP rank runs the graph's token count")
        if runner in DECODE_RUNNERS and "num_speculative_steps" in g.baked:  # up to 0.31 steps are not a graph argument
            v.expect_equal("capture sizes", "num_speculative_steps", w, cfg.num_speculative_tokens, g.baked["num_speculative_steps"])
        if runner == DECODE_RUNNERS[1]:
            v.expect_equal("capture sizes", "draft steps in the graph", w, list(range(1, cfg.num_speculative_tokens)), g.baked["draft_steps"],
                           "the fused graph holds all K - 1 draft steps, in order")
        elif runner == DECODE_RUNNERS[0]:
            v.expect_equal("capture sizes", "draft forwards in the graph", w, 1, len(g.baked["draft_steps"]),
                           "one draft step per graph; the step index is read from current_draft_step at replay")
    w = {"dp": dp, "rank": rank, "runner": runner}
    ends = (reqs[0], reqs[-1]) if reqs else None
    for name, want, reason in api.rules(rule_runner(runner), q, cfg, vcfg):
        v.expect_equal("capture sizes", name, w, want, ends if name == SMALLEST_LARGEST else reqs, reason)
    want_pw, reason = api.piecewise_rule(rule_runner(runner), cfg)
    v.expect_equal("capture sizes", "PIECEWISE token sizes", w, want_pw, cap.piecewise[runner], reason)


def expected_graph(order: DispatchOrder, full: dict[int, int], piecewise: list[int], needed: int, q: int) -> tuple[str, Optional[int]]:
    """The graph a release dispatches `needed` requests of q tokens to: ("FULL", requests), ("PIECEWISE", tokens) or
    ("NONE", None). `full` maps each FULL uniform-decode graph's token count to its request count."""
    tokens = needed * q
    if order is DispatchOrder.SMALLEST_GRAPH:
        size = min((t for t in [*full, *piecewise] if t >= tokens), default=None)
        return ("NONE", None) if size is None else ("FULL", full[size]) if size in full else ("PIECEWISE", size)
    fits = [n for n in full.values() if n >= needed]
    if fits:
        return "FULL", min(fits)
    pw = [t for t in piecewise if t >= tokens]
    return ("PIECEWISE", min(pw)) if pw else ("NONE", None)


def check_iteration(lines: dict, seen: dict, reps: list[VllmReplay], caps: list[RankCapture], cfg: VllmCheckConfig, dp: int,
                    dispatch: DispatchOrder) -> None:
    """One iteration's replays of one runner, every rank."""
    runner = reps[0].rec.runner
    q = query_len(runner, cfg)
    needed = max(reps[0].dp_raw)
    # with graphs every rank runs one shape; eager ranks agree on the mode only (each runs its own count)
    agreed = {(r.cg_mode, r.rec.capture.num_tokens if r.cg_mode != "NONE" else None) for r in reps}
    for r in reps:
        rec = r.rec
        ln = line_for(lines, dp, runner, r)
        ln.raw_bs.add(rec.raw_bs)
        ln.ranks.add(r.rank)
        v = ln.verdict
        w = {"dp": dp, "runner": runner, "rank": r.rank, "iteration": r.iteration, "dp_raw": r.dp_raw, "raw_bs": rec.raw_bs, "bs": rec.bs}
        full = {d.num_reqs * q: d.num_reqs for d, _ in caps[r.rank].graphs[runner] if d.cg_mode.name == "FULL"}
        want = expected_graph(dispatch, full, caps[r.rank].piecewise[runner], needed, q)
        why = f"{dispatch.value}; the largest rank's {needed} requests, {needed * q} tokens"
        if want[0] == "PIECEWISE":
            v.expect_equal("padding", "graph (mode, tokens)", w, want, (r.cg_mode, rec.capture.num_tokens), why)
        else:
            want = want if want[0] == "FULL" else ("NONE", rec.raw_bs)
            got = (r.cg_mode, f"{rec.capture.num_tokens} tokens") if r.cg_mode == "PIECEWISE" else (r.cg_mode, rec.bs)  # no request count
            v.expect_equal("padding", "graph (mode, requests)", w, want, got, why)
        if dp > 1:
            v.expect_equal("DP", "(mode, num_tokens) on every rank", w, 1, len(agreed), f"the ranks ran {sorted(agreed, key=str)}")
        num_tokens = rec.capture.num_tokens
        if r.cg_mode != "NONE":
            v.expect_equal("DP", "num_tokens_across_dp", w, [num_tokens] * dp if dp > 1 else None, rec.global_num_tokens_gpu,
                           "every rank pads to the graph's count")
        if r.cg_mode == "FULL":
            v.expect_equal("padding", "num_tokens", w, rec.bs * q, num_tokens)
            if runner != "target_verify":
                v.expect_equal("I1", "num_tokens_across_dp", w, rec.capture.global_num_tokens_gpu, rec.global_num_tokens_gpu,
                               "baked at capture vs agreed at replay")
                v.expect_equal("I1", "num_tokens", w, rec.capture.host.get("num_tokens"), num_tokens, "baked at capture vs replayed")
        elif r.cg_mode == "NONE" and dp > 1 and runner == "target_verify":
            v.expect_equal("DP", "num_tokens_across_dp (eager)", w, [n * q for n in r.dp_raw], rec.global_num_tokens_gpu,
                           "eager: every rank's own count, unpadded")
        if runner in DECODE_RUNNERS:
            check_steps(v, r, cfg, w)
        if r.lanes is not None:
            check_lanes(v, r, cfg, seen, w)


def check_steps(v: Verdict, r: VllmReplay, cfg: VllmCheckConfig, w: dict) -> None:
    """Every draft step ran once, in order, and its forward ran on attention metadata derived from the buffers it reads:
    over its padded requests (one token each), with their query_start_loc and seq_lens as they are at that step."""
    v.expect_equal("steps", "draft steps run", w, list(range(1, cfg.num_speculative_tokens)), [s["step"] for s in r.steps],
                   "propose() runs draft steps 1 .. K - 1, eager or replayed")
    for s in r.steps:
        ws, md, lanes, n = {**w, "step": s["step"]}, s["metadata"], s["lanes"], s["num_tokens"]
        if not v.expect_equal("metadata", "derived", ws, True, md is not None, "the forward's attention metadata was built"):
            continue
        v.expect_equal("metadata", "requests", ws, n, len(md["seq_lens"]), "the forward's padded request count (one token each)")
        v.expect_equal("metadata", "query_start_loc", ws, lanes["query_start_loc"][: n + 1], md["query_start_loc"],
                       "derived (built or updated in place) from the query_start_loc this step reads")
        v.expect_equal("metadata", "seq_lens", ws, lanes["seq_lens"][:n], md["seq_lens"],
                       "derived (built or updated in place) from the seq_lens this step reads")


def check_lanes(v: Verdict, r: VllmReplay, cfg: VllmCheckConfig, seen: dict, w: dict) -> None:
    """What every draft step's forward reads. Step 1 reads the live batch after _prepare_decode_inputs; each later step
    reads what the step before left (update_draft_inputs: the id it sampled, positions and seq_lens one further) and the
    slot mappings refreshed for those positions. The stand-in model samples the id after the one it read (drive.py)."""
    for s in r.steps:
        _check_step_lanes(v, r, cfg, seen, {**w, "step": s["step"]}, s["step"] - 1, s["lanes"])


def _check_step_lanes(v: Verdict, r: VllmReplay, cfg: VllmCheckConfig, seen: dict, w: dict, done: int, lanes: dict) -> None:
    """One step's lanes, `done` draft steps after the first."""
    raw, bs, live = r.rec.raw_bs, r.rec.bs, r.live
    real = {
        "input_ids": [t + done for t in live["draft_tokens"]],
        "positions": [min(p + 1 + done, cfg.max_model_len - 1) for p in live["positions"]],
        "seq_lens": [min(s - j + 1 + done, cfg.max_model_len) for s, j in zip(live["target_seq_lens"], live["num_rejected"], strict=True)],
        "query_start_loc": list(range(raw + 1)),
    }
    if "slot_mapping" in lanes:  # one KV group, block table row r = blocks 100 + r * width .. (drive.py)
        width = -(-cfg.max_model_len // KV_BLOCK_SIZE)
        real["slot_mapping"] = [(100 + req * width + p // KV_BLOCK_SIZE) * KV_BLOCK_SIZE + p % KV_BLOCK_SIZE
                                for req, p in zip(live["idx_mapping"], real["positions"], strict=True)]
    why = "the live batch after _prepare_decode_inputs" if done == 0 else f"the live batch advanced by {done} draft step(s)"
    for name, want in real.items():
        v.expect_equal("lanes", f"{name} (real lanes)", w, want, lanes[name][: len(want)], why)
    if bs <= raw:
        return
    # a replayed graph's update_draft_inputs runs over the requests it was captured for: padded lanes' seq_lens advance
    # with the steps like a real lane's (0 at step 1) while their queries stay zero-length and their slots PAD_SLOT_ID
    canonical = {"query_start_loc": (raw + 1, bs + 1, raw), "seq_lens": (raw, bs, min(done, cfg.max_model_len))}
    if "slot_mapping" in lanes:
        canonical["slot_mapping"] = (raw, bs, PAD_SLOT_ID)
    for name, (lo, hi, value) in canonical.items():
        v.expect_equal("padded tail", name, {**w, "lanes": f"{lo}..{hi - 1}"}, [value] * (hi - lo), lanes[name][lo:hi],
                       "padded lanes: zero-length queries writing no KV, seq_lens 0 at step 1 and one further per step after, "
                       "whatever ran before")
    key = (r.rank, raw, bs, tuple(r.dp_raw), w["step"])
    for name in (*canonical, "input_ids", "positions"):
        lo, hi = (raw + 1, bs + 1) if name == "query_start_loc" else (raw, bs)
        pad = lanes[name][lo:hi]
        first = seen.setdefault((name, *key), (pad, r.iteration))
        if first[0] == pad:
            continue
        detail = (f"padded lanes {lo}..{hi - 1} hold {pad} at iteration {r.iteration} (after a larger batch) and held {first[0]} "
                  f"the first time (iteration {first[1]})")
        if name in canonical:
            v.checked += 1
            v.fail("canonical", name, w, first[0], pad, detail)
        elif ("noted", name) not in seen:
            seen[("noted", name)] = True
            v.notes.append(f"n/a: padded-lane {name} left stale by design (query length 0: never attended, "
                           f"outputs dropped): {detail} [dp={w['dp']}, rank={r.rank}, step={w['step']}]")


def line_for(lines: dict, dp: int, runner: str, r: Optional[VllmReplay]) -> VLine:
    modes = {"FULL": f"reqs={r.rec.bs} tokens={r.rec.capture.num_tokens}", "PIECEWISE": f"piecewise tokens={r.rec.capture.num_tokens}"} if r else {}
    bucket = "capture" if r is None else modes.get(r.cg_mode, "eager")
    key = (dp, runner, bucket)
    if key not in lines:
        lines[key] = VLine(runner, dp, bucket)
    return lines[key]
