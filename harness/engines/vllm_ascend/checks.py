"""Our invariants on vllm-ascend's merged draft graph, from the records drive.py returns; what does not apply, with why.

Every expected value is computed here from the configuration and the live batch the adapter
built, never read back from the engine: the capture sizes from the user's sizes and vLLM's
rounding rule, the graph a batch must replay from the smallest captured size holding its
tokens (after the DP agreement when the draft has one), each draft step's attention lengths
and KV slots from the requests' positions and block-table rows.

The NPU twist: a replayed ACL graph runs its captured attention tasks with the parameters the
host wrote into them before the replay (update_graph_params), not with the capture's. So
beyond capture = replay of what the graph bakes (its token count, its sampled rows, its DP
agreement), every captured task must be rewritten once per replay with its own step's
lengths, and those lengths must be the ones the graph's rows need (TND: the query lengths end
at the rows the captured kernel runs on).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from harness.engines.vllm_ascend.config import AscendCheckConfig, GraphMode, World
from harness.engines.vllm_ascend.drive import AscendReplay, Capture
from harness.engines.vllm_ascend.runner import FIRST_BLOCK, blocks_per_request, slot_of
from harness.props.p1_records import P1
from harness.verdict import Verdict

PADDING_SLOT_ID = -1  # vllm.v1.spec_decode.utils.PADDING_SLOT_ID: a KV write the kernel skips

NOT_APPLICABLE = [
    "I2/I4/I5 (logit rows per DP rank): the draft samples its own rows on each rank (token_indices_to_sample); no logits "
    "cross DP ranks (lmhead_tp and enable_reduce_sample, which would gather them, are off by default)",
    "I3 (MLP-TP vs attn-TP branch parity): vllm-ascend's proposer has no per-branch gathered-buffer metadata",
    "I6 (single- vs multi-layer runners): one merged graph holds every draft step (_run_merged_draft); there is no second "
    "draft runner to compare",
    "I7 (eager vs graph): the warm-up pass runs the same _run_merged_draft eagerly; the adapter checks the graph",
    "DP agreement of a dense draft: should_skip_allreduce_across_dp_group (utils.py:1253-1255) skips the collective for a "
    "dense drafter and sets no DP metadata: each rank pads alone and no collective in the draft graph depends on the others",
    "MC2 mask / MoE dispatch sizes: the stand-in draft has no MoE layer (a MoE draft's DP agreement is driven, its experts not)",
    "paged attention (_npu_paged_attention): off under a speculative config (attention/utils.py:104-106)",
]


@dataclass
class ALine:
    """One (world, bucket): the captures ("capture") or every replay of one graph, on every rank."""

    world: str
    bucket: str
    verdict: Verdict = field(default_factory=lambda: Verdict(P1))
    raw: set[int] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)
    captured: list[int] = field(default_factory=list)

    def identity(self) -> dict[str, Any]:
        """Where this line's findings sit, as a baseline names them (harness/engines/baseline.py)."""
        return {"world": self.world}

    def to_json(self) -> dict:
        return {"world": self.world, "bucket": self.bucket, "raw_bs": sorted(self.raw), "ranks": sorted(self.ranks),
                "captured_tokens": self.captured, "ok": self.verdict.ok, "checked": self.verdict.checked,
                "failures": [asdict(f) for f in self.verdict.failures], "notes": list(self.verdict.notes)}


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def settled_sizes(cfg: AscendCheckConfig) -> list[int]:
    """The capture sizes vLLM settles the user's to under a FULL decode mode with a draft: each rounded up to a multiple of
    1 + K, kept while within the largest given (CompilationConfig.adjust_cudagraph_sizes_for_spec_decode)."""
    q, cap = 1 + cfg.num_speculative_tokens, max(cfg.cudagraph_capture_sizes)
    return sorted({round_up(s, q) for s in cfg.cudagraph_capture_sizes if round_up(s, q) <= cap})


def capture_keys(cfg: AscendCheckConfig, mode: GraphMode) -> list[tuple[int, Optional[int], bool]]:
    """The (num_tokens, num_reqs, uniform) batch descriptors the runner captures: FULL_DECODE_ONLY keys uniform-decode
    batches of 1 + K tokens per request up to max_num_seqs; FULL keys every size with min(size, max_num_seqs) requests
    (vLLM's CudagraphDispatcher.initialize_cudagraph_keys)."""
    q, n = 1 + cfg.num_speculative_tokens, cfg.max_num_seqs
    if mode is GraphMode.FULL_DECODE_ONLY:
        return [(t, t // q, True) for t in settled_sizes(cfg) if q <= t <= q * n]
    return [(t, min(t, n), False) for t in settled_sizes(cfg)]


def expected_key(cfg: AscendCheckConfig, mode: GraphMode, tokens: int) -> Optional[tuple[int, Optional[int], bool]]:
    """The key of the smallest captured graph holding `tokens`; None (eager) when none does."""
    keys = [k for k in capture_keys(cfg, mode) if k[0] >= tokens]
    return min(keys) if keys else None


def line_for(lines: dict, world: World, bucket: str) -> ALine:
    key = (world.label, bucket)
    if key not in lines:
        lines[key] = ALine(world.label, bucket)
    return lines[key]


def check_capture(ln: ALine, world: World, rank: int, captures: dict, cfg: AscendCheckConfig) -> None:
    v, q, K = ln.verdict, 1 + cfg.num_speculative_tokens, cfg.num_speculative_tokens
    w = {"world": world.label, "rank": rank}
    keys = capture_keys(cfg, world.mode)
    v.expect_equal("capture sizes", "graphs (num_tokens, num_reqs, uniform)", w, keys, sorted(captures),
                   "one merged draft graph per FULL key of the runner's dispatcher, sizes rounded to multiples of 1 + K")
    ln.captured = [k[0] for k in sorted(captures)]
    ln.ranks.add(rank)
    for key, cap in sorted(captures.items()):
        n = key[0]
        wk = {**w, "graph": n}
        b = cap.baked
        v.expect_equal("I1", "baked num_input_tokens", wk, n, b["num_input_tokens"], "the capture pass runs the key's tokens")
        v.expect_equal("I1", "baked batch_size", wk, max(n // q, 1), b["batch_size"],
                       "dummy_run's batch_size: the requests the graph's draft steps 1.. run (llm_base_proposer.py:671)")
        v.expect_equal("I1", "baked sampled rows", wk, max(n // q, 1), b["sample_rows"], "one sampled row per request lane")
        v.expect_equal("I1", "baked num_tokens_across_dp", wk, [n] * world.dp if world.moe and world.dp > 1 else None, b["dp_tokens"],
                       "a MoE draft's DP metadata: every rank at the graph's tokens; a dense draft has none")
        v.expect_equal("NPU tasks", "attention tasks captured", wk, K, len(cap.graph.tasks),
                       "one FIA task per draft step (one draft attention layer), each rewritten before every replay")
        for task in cap.graph.tasks:
            wt = {**wk, "step": task.index}
            v.expect_equal("NPU tasks", "captured query rows", wt, n, task.query_rows,
                           "every draft step of the merged graph runs num_input_tokens rows (llm_base_proposer.py:1213)")
            v.expect_equal("NPU tasks", "captured q lengths end", wt, task.query_rows, task.captured["actual_seq_lengths"][-1],
                           "TND layout: the query lengths sum to the rows the kernel runs on")


def check_step(lines: dict, world: World, reps: list[AscendReplay], cfg: AscendCheckConfig) -> None:
    """One iteration, every rank."""
    q = 1 + cfg.num_speculative_tokens
    agreed = max(r.raw for r in reps) * q
    shapes = {r.num_input_tokens for r in reps}
    for r in reps:
        tokens = agreed if world.moe and world.dp > 1 else r.raw * q
        want = expected_key(cfg, world.mode, tokens)
        bucket = f"tokens={r.desc[0]}" if r.mode == "FULL" else "eager"
        ln = line_for(lines, world, bucket)
        ln.raw.add(r.raw)
        ln.ranks.add(r.rank)
        v = ln.verdict
        w = {"world": world.label, "rank": r.rank, "iteration": r.iteration, "dp_raw": r.dp_raw, "raw_bs": r.raw}
        why = (f"the smallest captured graph holding {tokens} tokens"
               + (" (the ranks' agreed maximum: a MoE draft's DP collective)" if world.moe and world.dp > 1 else " (this rank's own)"))
        v.expect_equal("padding", "graph (mode, key)", w, ("FULL", want) if want else ("NONE", None),
                       (r.mode, r.desc if r.mode == "FULL" else None), why)
        if world.moe and world.dp > 1:
            v.expect_equal("DP", "num_input_tokens on every rank", w, 1, len(shapes), f"the ranks ran {sorted(shapes)} tokens")
            v.expect_equal("DP", "num_tokens_across_dp", w, [r.num_input_tokens] * world.dp, r.num_tokens_across_dp,
                           "every rank pads to the agreed count")
        if r.mode != "FULL" or r.capture is None:
            continue
        cap = r.capture
        v.expect_equal("replay", "graph replays this step", w, 1, r.replays, "_propose replays the key's graph once")
        v.expect_equal("I1", "num_input_tokens", w, cap.baked["num_input_tokens"], r.num_input_tokens, "baked at capture vs replayed")
        v.expect_equal("I1", "num_tokens_across_dp", w, cap.baked["dp_tokens"], r.num_tokens_across_dp,
                       "the DP agreement the graph's collectives were captured with vs the replay's")
        check_tasks(v, r, cap, cfg, w)
        check_slots(v, r, cap, cfg, w)
        check_lanes(v, r, cap, cfg, w)


def _lane_positions(r: AscendReplay, step: int) -> list[int]:
    """Each real request's position at draft step `step` (step 0: its sampled token's)."""
    return [p + step for p in r.live["sampled_positions"]]


def check_tasks(v: Verdict, r: AscendReplay, cap: Capture, cfg: AscendCheckConfig, w: dict) -> None:
    """Every captured attention task rewritten once, with its own step's lengths (module docstring)."""
    q, raw, n = 1 + cfg.num_speculative_tokens, r.raw, cap.num_tokens
    for step, task in enumerate(r.tasks):
        ws = {**w, "step": step}
        if not v.expect_equal("NPU tasks", "updates before the replay ran", ws, 1, len(task["updates"]),
                              "update_graph_params rewrites every captured task once per replay (else it runs with the "
                              "capture's lengths)"):
            continue
        u = task["updates"][0]
        qlens, kvlens, table = u["actual_seq_lengths"], u["actual_seq_lengths_kv"], u["block_table"]
        v.expect_equal("NPU tasks", "q lengths end (TND)", ws, task["rows"], qlens[-1],
                       "the query lengths must sum to the rows the captured kernel runs on")
        v.expect_equal("NPU tasks", "kv lengths per q length", ws, len(qlens), len(kvlens), "one KV length per request of the batch")
        v.expect_equal("NPU tasks", "block table rows >= requests", ws, True, len(table) >= len(qlens))
        if step == 0:
            real_q = [q * (i + 1) for i in range(raw)]
            pad_q = ([q * (i + 1) for i in range(raw, n // q)] if cap.uniform else ([n] if raw * q < n else []))
            v.expect_equal("lanes", "step 0 q lengths", ws, real_q + pad_q, qlens,
                           "1 + K tokens per request; the padded tokens as whole requests (uniform keys) or one dummy request")
            v.expect_equal("lanes", "step 0 kv lengths (real lanes)", ws, r.live["seq_lens"], kvlens[:raw],
                           "each request's length after its verified tokens")
            v.expect_equal("padded tail", "step 0 kv lengths", {**ws, "lanes": f"{raw}..{len(kvlens) - 1}"}, [0] * (len(kvlens) - raw),
                           kvlens[raw:], "padded requests attend nothing (the runner zeroes their seq_lens)")
        else:
            v.expect_equal("lanes", f"step {step} q lengths", ws, list(range(1, n + 1)), qlens,
                           "steps 1.. run one row per lane over all num_input_tokens rows")
            v.expect_equal("kv length", f"step {step} kv lengths (real lanes)", ws, [p + 1 for p in _lane_positions(r, step)],
                           kvlens[:raw], "a draft token at position p attends its request's KV up to p: its own length p + 1 "
                           "(vLLM's proposer subtracts the rejected drafts first: `common_attn_metadata.seq_lens -= "
                           "num_rejected_tokens_gpu`, vllm/v1/spec_decode/llm_base_proposer.py)")
            v.expect_equal("padded tail", f"step {step} kv lengths", {**ws, "lanes": f"{raw}..{n - 1}"}, [0] * (n - raw), kvlens[raw:],
                           "padded lanes attend nothing")
        width = blocks_per_request(cfg)
        v.expect_equal("lanes", f"step {step} block rows (real lanes)", ws, [FIRST_BLOCK + i * width for i in range(raw)],
                       [row[0] for row in table[:raw]], "each request's own block-table row")


def check_slots(v: Verdict, r: AscendReplay, cap: Capture, cfg: AscendCheckConfig, w: dict) -> None:
    """The KV slots each step's captured write reads at replay, and the writes the replay made."""
    q, K, n = 1 + cfg.num_speculative_tokens, cfg.num_speculative_tokens, cap.num_tokens
    seq_before = [s - q for s in r.live["seq_lens"]]
    for step in range(K):
        ws = {**w, "step": step}
        rows = r.slot_rows[step]
        if step == 0:
            real = [slot_of(cfg, i, s + j) for i, s in enumerate(seq_before) for j in range(q)]
        else:
            real = [slot_of(cfg, i, p) for i, p in enumerate(_lane_positions(r, step))]
        v.expect_equal("lanes", f"step {step} slots (real lanes)", ws, real, rows[: len(real)],
                       "each verified token's slot (step 0); each lane's next position in its own blocks (steps 1..)")
        v.expect_equal("padded tail", f"step {step} slots", {**ws, "lanes": f"{len(real)}..{n - 1}"},
                       [PADDING_SLOT_ID] * (n - len(real)), rows[len(real):], "padded rows write no KV (PADDING_SLOT_ID)")
    v.expect_equal("KV writes", "writes launched by the replay", w, K, len(r.kv_writes), "one KV write per draft step")
    for step, (written, rows) in enumerate(zip(r.kv_writes, r.slot_rows, strict=False)):  # a count mismatch failed above
        v.expect_equal("KV writes", f"step {step} slots written", {**w, "step": step}, rows, written,
                       "the captured write reads its step's slot buffer as the host left it")


def check_lanes(v: Verdict, r: AscendReplay, cap: Capture, cfg: AscendCheckConfig, w: dict) -> None:
    """What the graph's forwards read and proposed for the real lanes; the padded lanes' sampled rows."""
    K, raw = cfg.num_speculative_tokens, r.raw
    lanes = cap.baked["sample_rows"]
    v.expect_equal("lanes", "sampled rows (real lanes)", w, r.live["sample_idx"], r.sample_rows[:raw],
                   "the row of each request's last accepted token")
    v.expect_equal("padded tail", "sampled rows", {**w, "lanes": f"{raw}..{lanes - 1}"}, [0] * (lanes - raw), r.sample_rows[raw:],
                   "padded lanes sample row 0, whatever a larger batch left")
    v.expect_equal("steps", "draft forwards in the replay", w, K, len(r.steps), "the merged graph's K draft steps")
    for step in range(1, min(K, len(r.steps))):
        ws = {**w, "step": step}
        want_ids = [nx + step for nx in r.live["next_ids"]]
        v.expect_equal("lanes", f"step {step} input ids (real lanes)", ws, want_ids, r.steps[step]["input_ids"][:raw],
                       "the id the step before sampled")
        v.expect_equal("lanes", f"step {step} positions (real lanes)", ws, _lane_positions(r, step), r.steps[step]["positions"][:raw],
                       "one past the step before")
    v.expect_equal("lanes", "drafts (real lanes)", w, [[nx + 1 + k for k in range(K)] for nx in r.live["next_ids"]], r.draft,
                   "the stand-in draft proposes the id after the one it read, step after step")
