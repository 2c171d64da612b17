"""P1, fast path: every graph runner's get_forward_batch and replay fill driven without a model, per layout and schedule."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from harness.props.p1_records import P1, check_replay_record, record_where, verify_capture_bs
from harness.props.p1_shapes import MULTI_STEP_KINDS, check_live_attention_batch, check_ragged_gather_index
from harness.ranks.simulated import one_torch_thread
from harness.run.layouts import branch_sibling
from harness.run.observe import RunnerObserver
from harness.run.records import ReplayRecord
from harness.run.rig import decode_runner, draft_extend_runners, verify_runner
from harness.verdict import Verdict
from runners.base_cuda_graph_runner import RunnerKind
from runners.config import DEFAULT_MODEL, ModelConfig, SpecConfig, draft_input_hidden_size
from runners.decode_cuda_graph_runner import VerifyInputs, verify_inputs
from runners.draft_extend import DraftExtendInputs
from runners.eagle_draft import DraftDecodeInputs
from runners.parallel.layout import ParallelLayout
from runners.target import Lane


def _synthetic_inputs(raw_bs: int, T: int, hidden: int, dp_batch_sizes: list[int], seed: int) -> DraftExtendInputs:
    g = torch.Generator().manual_seed(seed)
    n = raw_bs * T
    return DraftExtendInputs(
        input_ids=torch.zeros(n, dtype=torch.int64),
        positions=torch.zeros(n, dtype=torch.int64),
        seq_lens=torch.randint(T, 4 * T, (raw_bs,), generator=g),
        req_pool_indices=torch.arange(1, raw_bs + 1),
        hidden_states=torch.zeros(n, hidden),
        accept_lens=torch.randint(1, T + 1, (raw_bs,), generator=g),
        dp_batch_sizes=list(dp_batch_sizes),
    )


# tiny tensors: torch's intra-op pool only spins (harness/ranks/simulated.py); a verify runner's chain-mask tril alone,
# which parallelizes even a single T x T matrix, costs ms a call with the pool on a busy machine
@one_torch_thread()
def check_metadata(
    layout: ParallelLayout,
    spec: SpecConfig,
    schedule: Sequence[Sequence[int]],
    model: ModelConfig = DEFAULT_MODEL,
    seed: int = 0,
) -> Verdict:
    """P1 over one layout and a schedule (per iteration: each DP group's raw batch size).

    Drives every graph runner of one rank per DP group (each multi-layer draft-extend step, the
    single-layer draft-extend, the target verify and the draft decode) through capture-time
    get_forward_batch and replay-time prepare_replay, observed from outside (harness.run.observe).
    """
    v = Verdict(P1)
    T = spec.num_tokens_per_bs
    step0_rows: dict[int, dict[int, int]] = {}  # per DP group: the step-0 runner's logprob rows per request (I3)
    for d in range(layout.attn_dp_size):
        tp_rank = d * layout.attn_tp_size
        runners = [RunnerObserver(r) for r in draft_extend_runners(layout, spec, model, tp_rank)]
        lp_by_runner: dict[tuple[str, int], list[Optional[int]]] = {}
        bs_by_runner: dict[tuple[str, int], list[int]] = {}
        step0: dict[int, ReplayRecord] = {}
        for it, sizes in enumerate(schedule):
            dp_sizes = _dp_sizes(layout, sizes)
            raw_bs = dp_sizes[d]
            inp = _draft_extend_input(spec, model, dp_sizes, d, it, seed)
            for obs in runners:
                r = obs.runner
                if not r.can_run(inp):
                    continue
                rec = obs.prepare(inp)
                if obs is runners[0]:
                    step0[it] = rec
                dl = r.layout  # the draft's: the target's, or its own (SpecConfig.draft_tp_size)
                needed = max(dp_sizes) if dl.require_mlp_tp_gather else raw_bs
                piecewise = r.runner_kind is RunnerKind.PIECEWISE
                check_replay_record(v, dl, rec, tp_rank, it, needed, pads_requests=not piecewise)
                if piecewise:
                    check_live_attention_batch(v, dl, r, rec, tp_rank, it)
                if r.runner_kind is RunnerKind.RAGGED:
                    check_ragged_gather_index(v, r.buffers, inp, rec.bs, r.T, record_where(dl, rec, tp_rank, it))
                host_lp = rec.capture.host["global_num_tokens_for_logprob_cpu"]
                own = None if host_lp is None else host_lp[d if dl.require_mlp_tp_gather else 0]
                lp_by_runner.setdefault((r.runner_kind, r.step), []).append(own)
                bs_by_runner.setdefault((r.runner_kind, r.step), []).append(rec.bs)
        _check_verify_metadata(v, layout, spec, schedule, model, tp_rank, seed)
        _check_decode_metadata(v, layout, spec, schedule, model, tp_rank, seed)
        # I6: single-layer and multi-layer agree on for_logprob (each multi-layer step vs single)
        single = lp_by_runner.get((RunnerKind.SINGLE_LAYER, 0), [])
        single_bs = bs_by_runner.get((RunnerKind.SINGLE_LAYER, 0), [])
        for (kind, step), vals in lp_by_runner.items():
            if kind in MULTI_STEP_KINDS and any(x is not None for x in single + vals):  # the neither branch bakes no counts
                same_buckets = bs_by_runner[(kind, step)] == single_bs
                v.expect_agree("I6", "global_num_tokens_for_logprob", {"layout": layout.describe(), "rank": tp_rank, "step": step},
                               {"single-layer runner": single, f"multi-layer runner (step {step})": vals},
                               [b * T for b in single_bs] if same_buckets else None,
                               "bs * T per batch, every DRAFT_EXTEND_V2 token of the bucket it replays" if same_buckets else
                               "one value for the same batches (the two runners replayed different buckets)")
        step0_rows[d] = _logprob_rows_per_request(layout, d, step0)
    _check_branch_parity(v, layout, spec, schedule, model, seed, step0_rows)
    return v


def _dp_sizes(layout: ParallelLayout, sizes: Sequence[int]) -> list[int]:
    """One iteration's row of the schedule as the runners' dp_batch_sizes: [bs] without DP attention."""
    return list(sizes) if layout.attn_dp_size > 1 else [sizes[0]]


def _draft_extend_input(spec: SpecConfig, model: ModelConfig, dp_sizes: list[int], d: int, it: int, seed: int) -> DraftExtendInputs:
    """DP group d's draft-extend batch of iteration `it`: what each of the group's draft-extend runners replays."""
    return _synthetic_inputs(dp_sizes[d], spec.num_tokens_per_bs, draft_input_hidden_size(model, spec), dp_sizes, seed + 1000 * it + d)


def _check_verify_metadata(v: Verdict, layout: ParallelLayout, spec: SpecConfig, schedule, model: ModelConfig, tp_rank: int, seed: int) -> None:
    """I1, I4, I5 and the padding rules for the TARGET_VERIFY runner of one rank: logits for every token, like DRAFT_EXTEND_V2."""
    d = layout.attn_dp_rank(tp_rank)
    runner = verify_runner(layout, spec, model, tp_rank)
    observer = RunnerObserver(runner)
    T = spec.num_tokens_per_bs
    trees = spec.topk > 1 and T >= 3  # fewer nodes make only chains
    for it, sizes in enumerate(schedule):
        dp_sizes = _dp_sizes(layout, sizes)
        g = torch.Generator().manual_seed(seed + 1000 * it + d)
        raw_bs = dp_sizes[d]
        inp = _verify_batch(raw_bs, T, dp_sizes, trees, g)
        if runner.can_run(inp):
            needed = max(dp_sizes) if layout.require_mlp_tp_gather else raw_bs
            check_replay_record(v, layout, observer.prepare(inp), tp_rank, it, needed,
                                expected_capture_bs=verify_capture_bs(layout, spec.capture_bs, spec.max_running_requests, T))


def _verify_batch(raw_bs: int, T: int, dp_sizes: list[int], trees: bool, g: torch.Generator) -> VerifyInputs:
    """A verify batch of random lengths, as the loop builds it; with `trees` every lane a tree that is not a chain,
    so that a padded lane left on a larger batch's tree differs from the chain mask of the fill, host and device."""
    starts = torch.randint(0, 3 * T, (raw_bs,), generator=g).tolist()
    lanes = [Lane(i + 1, start, [0] * T, _non_chain_tree(T, g) if trees else None) for i, start in enumerate(starts)]
    return verify_inputs(lanes, dp_sizes, torch.device("cpu"), T)


def _non_chain_tree(T: int, g: torch.Generator) -> list[int]:
    """Parents of T >= 3 nodes (node 0 the root): each node under a random earlier one, the last never under its
    predecessor, so the tree is not the chain."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T - 1)]
    return parents + [int(torch.randint(0, T - 2, (1,), generator=g))]


def _check_decode_metadata(v: Verdict, layout: ParallelLayout, spec: SpecConfig, schedule, model: ModelConfig, tp_rank: int, seed: int) -> None:
    """I1, I4, I5 and the padding rules of one rank's draft-decode runner (runners.eagle_draft_cuda_graph_runner): DECODE counts bs * topk lanes."""
    if spec.num_steps < 2:
        return  # one draft step is the draft-extend's own: the engine builds no draft-decode runner
    k = spec.topk
    runner = decode_runner(layout, spec, model, tp_rank)
    if runner is None:
        return  # no draft on this rank (SpecConfig.draft_tp_size)
    observer = RunnerObserver(runner)
    d = layout.attn_dp_rank(tp_rank)
    for it, sizes in enumerate(schedule):
        dp_sizes = _dp_sizes(layout, sizes)
        raw_bs = dp_sizes[d]
        g = torch.Generator().manual_seed(seed + 1000 * it + d)
        seq = torch.randint(1, 4 * k + 8, (raw_bs,), generator=g)
        inp = DraftDecodeInputs(torch.ones(raw_bs, k), torch.zeros(raw_bs, k, dtype=torch.int64), torch.zeros(raw_bs, model.hidden_size),
                                seq, torch.arange(1, raw_bs + 1), seq.repeat_interleave(k), dp_sizes)
        if runner.can_run(inp):
            dl = runner.worker.ctx.layout  # the draft's (SpecConfig.draft_tp_size)
            needed = max(dp_sizes) if dl.require_mlp_tp_gather else raw_bs
            check_replay_record(v, dl, observer.prepare(inp), tp_rank, it, needed)


@one_torch_thread()  # as check_metadata
def check_decode_metadata(layout: ParallelLayout, spec: SpecConfig, schedule: Sequence[Sequence[int]], model: ModelConfig = DEFAULT_MODEL,
                          seed: int = 0) -> Verdict:
    """P1 of the draft-decode runner alone, on every rank of the layout."""
    v = Verdict(P1)
    for tp_rank in range(layout.world_size):
        _check_decode_metadata(v, layout, spec, schedule, model, tp_rank, seed)
    return v


def _logprob_rows_per_request(layout: ParallelLayout, d: int, step0: dict[int, ReplayRecord]) -> dict[int, int]:
    """for_logprob of DP group d's step-0 runner divided by its padded bs, per iteration it replayed (`step0`: its
    replay record of each)."""
    out = {}
    for it, rec in step0.items():
        lp = rec.capture.host["global_num_tokens_for_logprob_cpu"]
        if lp is None:
            continue  # a draft in its own plain-TP layout (SpecConfig.draft_tp_size) bakes no counts: no branch to compare
        out[it] = lp[d if layout.require_mlp_tp_gather else 0] // rec.bs
    return out


def _step0_replays(layout: ParallelLayout, spec: SpecConfig, schedule, model: ModelConfig, d: int, seed: int) -> dict[int, ReplayRecord]:
    """DP group d's step-0 draft-extend runner alone over the schedule, as check_metadata drives it: its replay record of
    each iteration it could replay."""
    observer = RunnerObserver(draft_extend_runners(layout, spec, model, d * layout.attn_tp_size)[0])
    out = {}
    for it, sizes in enumerate(schedule):
        inp = _draft_extend_input(spec, model, _dp_sizes(layout, sizes), d, it, seed)
        if observer.runner.can_run(inp):
            out[it] = observer.prepare(inp)
    return out


def _check_branch_parity(v: Verdict, layout: ParallelLayout, spec: SpecConfig, schedule, model: ModelConfig, seed: int,
                         rows: dict[int, dict[int, int]]) -> None:
    """I3: the per-rank value is the same in the MLP and attn branches for the same batch.

    The two branches may pad to different buckets (the attn branch's base is attn_tp_size),
    so the comparable quantity is logprob rows per padded request: T in both. `rows`: this layout's, per DP group, from
    check_metadata's own replays (the same runner over the same batches); the sibling's step-0 runner is driven here.
    """
    sib = branch_sibling(layout)
    if sib is None:
        return
    for d in range(layout.attn_dp_size):
        ours = rows[d]
        theirs = _logprob_rows_per_request(sib, d, _step0_replays(sib, spec, schedule, model, d, seed))
        both = sorted(set(ours) & set(theirs))  # iterations both branches could replay (buckets differ)
        if not both:
            continue  # no batch both branches replay: nothing to compare (not a check)
        ours, theirs = [ours[i] for i in both], [theirs[i] for i in both]
        T = spec.num_tokens_per_bs
        v.expect_agree(
            "I3", "global_num_tokens_for_logprob",
            {"layout": layout.describe(), "sibling": sib.describe(), "rank": d * layout.attn_tp_size},
            {f"{layout.branch.value} branch (this layout)": ours, f"{sib.branch.value} sibling": theirs},
            [T] * len(both), f"T = {T} logprob rows per padded request (every DRAFT_EXTEND_V2 token) in both branches",
        )

