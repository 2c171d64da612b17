"""Mutants of the one-graph draft-extend composite (OneGraphMultiLayerEagleMultiStepDraftExtendCudaGraphRunner, in
runners.multi_layer_eagle_draft_extend_cuda_graph_runner): one per mechanism it adds to the per-step composite. Each is
killed by P3 (eager vs graph, per step) on the one-graph case; the snapshot and restore around SGLang's capture has no
mutant, because our prepare leaves nothing for it to guard (the class docstring says why).
"""
from __future__ import annotations

from harness.mutants.base import Mutant
from runners.draft_extend import DraftExtendInputs, StepOutputs
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import (
    MultiLayerEagleDraftExtendCudaGraphRunner,
    OneGraphDraftExtendStepRunner,
)
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import (
    OneGraphMultiLayerEagleMultiStepDraftExtendCudaGraphRunner as OneGraph,
)

PROBE = "case-one-graph"  # harness.pipeline.mutants: P1, P3 and P4 over cases/tp2_shrink_one_graph.toml


def _no_chain_in_graph(self: OneGraph, num_tokens: int, out: StepOutputs) -> None:
    pass


def _chain_on_host(self: OneGraph, step: int, inp: DraftExtendInputs) -> StepOutputs:
    if step:  # as the per-step composite: the previous step's live rows, written between the steps
        raw_n = inp.bs * self.runners[0].T
        self.buffers.input_ids[:raw_n].copy_(inp.input_ids)
        self.buffers.hidden_states[:raw_n].copy_(inp.hidden_states)
    return self.runners[step].replay(inp)


def _one_logits_buffer(self: OneGraph, step: int):
    return self.buffers.next_token_logits_buffer


def _replays_every_step(self: OneGraphDraftExtendStepRunner, bs: int, attn) -> StepOutputs:
    first = self.composite.runners[0]  # the one graph, kept by the first step's runner
    self.composite.served = MultiLayerEagleDraftExtendCudaGraphRunner._replay_graph(first, bs, attn)
    return self.composite.served[self.step]


def _served_unsliced(self: OneGraphDraftExtendStepRunner, inp: DraftExtendInputs, bs: int) -> StepOutputs:
    return self._replay_graph(bs, self.worker.attn)


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "one-graph-chain-on-host",
        "the one-graph composite captures the steps without the chain between them and writes each step's token ids and "
        "hidden states on the host before serving the next, as the per-step driver does: the one replay has run every "
        "step by then, so the later steps drafted from step 0's inputs",
        "host write between steps of one graph",
        ((OneGraph, "_chain", _no_chain_in_graph), (OneGraph, "replay", _chain_on_host)),
        (PROBE,),  # P3, P4
    ),
    Mutant(
        "one-graph-steps-share-logits",
        "every step of the one graph writes its logits into the one buffer the per-step runners share: step k+1 "
        "overwrites step k's inside the replay, so every step is served the last step's logits",
        "graph output overwritten inside one replay",
        ((OneGraph, "_logits_buffer", _one_logits_buffer),),
        (PROBE,),  # P3, P4
    ),
    Mutant(
        "one-graph-replays-every-step",
        "every step replays the one graph instead of being served from step 0's replay: the later replays start from the "
        "buffers the first one's in-graph chain rotated, so step k is the first step of a chain that began past step 0",
        "one graph replayed per step",
        ((OneGraphDraftExtendStepRunner, "_replay_graph", _replays_every_step),),
        (PROBE,),
    ),
    Mutant(
        "one-graph-served-unsliced",
        "the steps are served the one replay's outputs whole, the bucket's padded lanes included, not sliced to the "
        "raw batch",
        "padded rows handed out",
        ((OneGraphDraftExtendStepRunner, "_replay_filled", _served_unsliced),),
        (PROBE,),  # P3
    ),
)
