"""Mutants of mixed forward modes across DP ranks (runners.mixed_modes): what a rank decides from its own mode where the
gathered one must decide, and the reverse, and a collective sized by this rank's count. The mixed-modes case's probe
kills them (P7: a desync is named by rank and collective; P6)."""
from __future__ import annotations

from harness.mutants.base import Mutant
from runners import mlp_sync
from runners.batch import ForwardMode
from runners.mixed_modes import DpIteration
from runners.parallel.layout import DpPaddingMode


def _padding_from_local_mode(self: DpIteration) -> DpPaddingMode:
    return DpPaddingMode.SUM_LEN if self.forward_mode is ForwardMode.EXTEND else DpPaddingMode.MAX_LEN


def _graphs_from_local_mode(self: DpIteration) -> bool:
    return self.forward_mode is not ForwardMode.EXTEND


def _dp_tokens_local_count(self: DpIteration) -> list[int]:
    return [self.sync.num_tokens[self.dp_rank]] * len(self.sync.num_tokens)


def _prefill_on_global_flag(self: DpIteration) -> bool:
    return self.sync.is_extend_in_batch


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "mixed-padding-from-local-mode",
        "a DP group picks the padding mode of a mixed iteration from its own forward mode instead of the gathered "
        "is_extend_in_batch: the extending group gathers SUM_LEN (an all-reduce of the summed rows), the decoding and idle "
        "ones MAX_LEN (an all-gather of padded rows)",
        "routing on the local mode",
        ((DpIteration, "padding_mode", _padding_from_local_mode),),
        ("mixed-modes-case",),  # P7: a CollectiveMismatch at the first mixed step
    ),
    Mutant(
        "mixed-graphs-from-local-mode",
        "a DP group decides whether its verify may replay a graph from its own mode: in a mixed iteration the decoding "
        "group replays its bucket's graph (MAX_LEN shapes) while the extending group runs eagerly (SUM_LEN)",
        "routing on the local mode",
        ((DpIteration, "can_run_graph", _graphs_from_local_mode),),
        ("mixed-modes-case",),  # P7
    ),
    Mutant(
        "mixed-dp-tokens-local-count",
        "a mixed iteration's per-group token counts are this group's count repeated (the gathered counts ignored): the "
        "SUM_LEN buffer and offsets are sized by the local count, and an idle group skips the pass",
        "collective sized by the local count",
        ((DpIteration, "dp_tokens", _dp_tokens_local_count),),
        ("mixed-modes-case",),  # P7
    ),
    Mutant(
        "mixed-decode-routed-to-prefill",
        "a DP group takes the prefill path whenever the gathered is_extend_in_batch is set, as the uncoordinated worker "
        "routes: a decoding group prefills nothing and its requests skip the iteration's verify",
        "routing on the global flag where the local mode matters",
        ((DpIteration, "runs_prefill", _prefill_on_global_flag),),
        ("mixed-modes-case",),  # P6: the accept lengths per round move (P5 holds: the tokens are still the target's)
    ),
)


def _pads_sum_len_too(layout, fb) -> bool:
    return layout.require_mlp_sync and layout.attn_dp_size > 1 and fb.global_num_tokens_cpu is not None  # whatever the mode


MUTANTS += (
    Mutant(
        "mixed-sum-len-batch-padded",
        "eager MLP-sync pads a SUM_LEN batch to the DP maximum as it pads a MAX_LEN one: a short group's padded rows land "
        "in the next group's part of the unpadded gathered buffer",
        "collective sized by the wrong mode",
        ((mlp_sync, "needs_dp_padding", _pads_sum_len_too),),
        ("mixed-modes-case",),  # P5: the next group's rows summed with padding
    ),
)
