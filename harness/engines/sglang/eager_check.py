"""I7 on the engine: its eager draft-extend batch (eager.py) against what its graph runner bakes, per DP rank (docs/engine-check.md, I7).

Two checks per DP rank of every distinct DP load of the schedule (an idle DP rank among them):
the eager batch's for_logprob equals the rows its own logits processor hands lm_head (the
seed bug's shape, on the eager path), and, per padded token, what the graph bakes for the
bucket the same live batch replays in (the multi-layer runner's step 0, as captured). Also
its token count: bs_r * T, as the graph's replay fill counts. Failures sit on lines of their
own (runner `eager`), so they are never put on a graph runner.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Any, Callable, Optional

import torch

from harness.engines.after_model import hidden_rows
from harness.engines.sglang import eager, logits_gather
from harness.engines.sglang.build import EngineRunners
from harness.engines.sglang.errors import MissingEngineAttribute
from harness.ranks.sim_failures import RankFailure
from runners.parallel.layout import ParallelLayout

KIND = "eager"


def dp_loads(layout: ParallelLayout, schedule: list[list[int]]) -> list[list[int]]:
    """Each distinct DP load of the schedule, then each DP group in turn idle while the others run a full bucket."""
    loads = list(dict.fromkeys(tuple(s) for s in schedule))
    dp = layout.attn_dp_size
    if dp > 1:
        full = max(max(s) for s in schedule)
        loads += [tuple(0 if g == idle else full for g in range(dp)) for idle in range(dp)]
    return [list(x) for x in loads]


def check_eager(runners: EngineRunners, layout: ParallelLayout, schedule: list[list[int]], per_request: dict,
                line: Callable[[str, int, int], Any], gather: Optional[logits_gather.GatherCheck] = None) -> Optional[str]:
    """I7 on every DP load; returns why I7 is n/a on this release (its eager path cannot be driven), else None.
    Where the layout's logits processor gathers across DP groups (gather), the engine's gather also runs on the
    eager batches of one mixed load and of each idle load: what a wrong count does to the logits (dp-gather)."""
    engine, cfg = runners.engine, runners.cfg
    graph = runners.multi[0]
    T, buckets = graph.tokens_per_bs, sorted(graph.capture_bs)
    try:
        syncs, mixed_done = eager.require_mlp_sync(engine, runners.server_args), False
        for dp_sizes in dp_loads(layout, schedule):
            synced = (eager.sync_counts(engine, layout, runners.server_args, dp_sizes, T, cfg.max_running_requests,
                                        layout.require_mlp_tp_gather) if syncs else
                      [eager.unsynced(engine, b, T, cfg.max_running_requests) for b in dp_sizes])
            batches = [eager.eager_batch(engine, runners, batch, d, dp_sizes) for d, batch in enumerate(synced)]
            for eb in batches:
                _check_one(eb, layout, dp_sizes, buckets, per_request, line)
            if gather is not None and (0 in dp_sizes or (len(set(dp_sizes)) > 1 and not mixed_done)):
                mixed_done = mixed_done or 0 not in dp_sizes
                _check_gather(gather, runners, batches, layout, dp_sizes, buckets, line)
    except (MissingEngineAttribute, ModuleNotFoundError) as e:
        return _na(engine, e)
    except RankFailure as e:
        if isinstance(e.root_exception, (MissingEngineAttribute, ModuleNotFoundError)):
            return _na(engine, e.root_exception)
        raise
    return None


def _na(engine: Any, e: BaseException) -> str:
    return (f"I7 (eager vs graph): n/a on sglang {engine.version}: its scheduler MLP sync / eager draft-extend worker is not the API "
            f"the adapter drives ({type(e).__name__}: {e})")


def _check_one(eb: eager.EagerBatch, layout: ParallelLayout, dp_sizes: list[int], buckets: list[int], per_request: dict, line) -> None:
    bucket = _bucket(layout, dp_sizes, eb.raw_bs, buckets)
    tp_rank = eb.group * layout.attn_tp_size
    ln = line(KIND, 0, bucket)
    ln.tokens_per_bs, ln.ranks, ln.pruned = eb.tokens_per_bs, ln.ranks | {tp_rank}, ln.pruned or eb.pruned
    ln.raw_bs.add(eb.raw_bs)
    v = ln.verdict
    w = {"layout": layout.describe(), "branch": layout.branch.value, "runner": KIND, "step": 0, "rank": tp_rank, "dp_sizes": list(dp_sizes),
         "raw_bs": eb.raw_bs, "bs": bucket}
    g_lp = per_request.get((layout, tp_rank, "multi_layer", 0), {}).get(bucket, (None,))[0]
    n = eb.raw_bs * eb.tokens_per_bs
    if eb.global_num_tokens_for_logprob is None:
        v.expect_equal("I7", "global_num_tokens_for_logprob (eager)", w, "absent" if g_lp is None else "present", "absent",
                       "the eager batch carries DP counts where the graph bakes them")
        return
    own = eb.group if layout.require_mlp_tp_gather else 0
    v.expect_equal("I7", "global_num_tokens (eager)", w, n, eb.global_num_tokens[own], "tokens, bs_r * T, as the graph's replay fill counts")
    v.expect_equal("I7", "global_num_tokens_for_logprob (eager)", w, eb.rows_fed, eb.global_num_tokens_for_logprob[own],
                   "the rows the eager logits processor hands lm_head" + (" (pruned to one per request)" if eb.pruned else
                                                                          " (every token: the worker does not prune here)"))
    if g_lp is not None and n:
        v.expect_equal("I7", "global_num_tokens_for_logprob (eager vs graph)", w, Fraction(g_lp) * n, Fraction(eb.global_num_tokens_for_logprob[own]),
                       f"the graph's for_logprob per padded token at bucket {bucket} ({g_lp}) times this rank's {n} tokens")


def _bucket(layout: ParallelLayout, dp_sizes: list[int], raw: int, buckets: list[int]) -> int:
    needed = max(dp_sizes) if layout.require_mlp_tp_gather else raw
    return next((b for b in buckets if b >= max(needed, 1)), buckets[-1])


def _check_gather(gather: logits_gather.GatherCheck, runners: EngineRunners, batches: list[eager.EagerBatch], layout: ParallelLayout,
                  dp_sizes: list[int], buckets: list[int], line) -> None:
    """The engine's logits-processor DP gather on the eager batches of one load: each rank gets lm_head of its own rows."""
    lp, H = runners.engine.modules["logits"], runners.cfg.hidden_size
    inputs = {}
    for eb in batches:
        fb = eb.forward_batch
        hidden = runners.multi[0].pruned_states(fb, hidden_rows(fb.input_ids, H)) if eb.raw_bs else torch.zeros(0, H)
        inputs[eb.group] = logits_gather.GatherInput(eb.raw_bs, _bucket(layout, dp_sizes, eb.raw_bs, buckets),
                                                     lp.LogitsMetadata.from_forward_batch(fb), hidden)
    bucket = _bucket(layout, dp_sizes, max(dp_sizes), buckets)
    v = line(KIND, 0, bucket).verdict
    w = {"layout": layout.describe(), "branch": layout.branch.value, "runner": KIND, "step": 0, "dp_sizes": list(dp_sizes), "bs": bucket}
    try:
        outs = gather.run(inputs)
    except RankFailure as e:
        v.checked += 1
        v.fail(logits_gather.CHECK, "logits", {**w, "rank": e.root_rank}, "each rank's logits", f"the gather raised: {e.root_exception!r}",
               "the engine's logits processor gather on the eager batch, run on every TP rank")
        return
    for r, got in enumerate(outs):
        mine = inputs[layout.attn_dp_rank(r)]
        logits_gather.compare(v, {**w, "rank": r, "raw_bs": mine.raw_bs}, mine.hidden @ gather.weight.T, got)
