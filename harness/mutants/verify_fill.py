"""Mutants of the TARGET_VERIFY graph runner's replay fill (runners.decode_cuda_graph_runner)."""
from __future__ import annotations

from harness.mutants.base import Mutant, keeps
from runners.decode_cuda_graph_runner import DecodeCudaGraphRunner

# ---- issue 20 item 3: the TARGET_VERIFY graph runner's replay fill (runners.decode_cuda_graph_runner) ----
# Killed by: the seq_lens fill by P1 (padded seq_lens / seq_lens_sum); the req_pool_indices fill (in-graph slot
# lookup) by P8 (a live request's KV overwritten changes later tokens), P3 (harness.props.verify_shadow: live target KV
# after the pass) and P5; the gathered fill by P1 (the replay fill). The other fill lines' mutants (input_ids,
# positions and out_cache_loc of padded lanes, the copy-in) are harness.mutants.replay_fill's.


def _verify_fill_gathered_requests(self: DecodeCudaGraphRunner, bs: int) -> None:
    if self.global_num_tokens_gpu is not None:
        self.global_num_tokens_gpu.fill_(bs)  # requests, not tokens: lm_head gets the first bs rows only
        self.global_num_tokens_for_logprob_gpu.fill_(bs)


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "verify-stale-padded-seq-lens",
        "TARGET_VERIFY replay fill skips seq_lens of the padded lanes: after the batch shrinks they keep the larger batch's lengths, so the baked seq_lens_sum no longer matches the buffer",
        "stale padded lane after shrink",
        ((DecodeCudaGraphRunner, "_fill_padded_lanes", keeps(DecodeCudaGraphRunner._fill_padded_lanes, "seq_lens")),),
        ("metadata-dp", "metadata-grid"),  # P1 (padded seq_lens), P2
    ),
    Mutant(
        "verify-padded-kv-write-stale-slot",
        "TARGET_VERIFY replay fill skips req_pool_indices of the padded lanes: their in-graph slot lookup goes through the larger batch's request rows, so they write KV into slots of requests that may still be running",
        "KV write for padded rows lands in a live slot",
        ((DecodeCudaGraphRunner, "_fill_padded_lanes", keeps(DecodeCudaGraphRunner._fill_padded_lanes, "req_pool_indices")),),
        ("churn-single-layer", "spec-cases"),  # P8 (a live request's KV overwritten), P3/P5/P6, P2
    ),
    Mutant(
        "verify-gathered-tokens-requests",
        "TARGET_VERIFY replay fill writes bs (requests) into global_num_tokens_gpu / global_num_tokens_for_logprob_gpu instead of bs * num_draft_tokens",
        "unit: requests vs tokens",
        ((DecodeCudaGraphRunner, "_fill_gathered", _verify_fill_gathered_requests),),
        ("metadata-dp", "metadata-grid"),  # P1 (fill), P2
    ),
)
