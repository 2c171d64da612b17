"""Mutants of the host-planned attention path (runners.attention.torch_planned, and the plan code it shares with
flashinfer's backend: runners.attention.flashinfer_plan). flashinfer runs on a GPU only; the torch_planned cases
(harness.props.backend_probes) run the same plan shape on CPU, where P3 and the loop's run see these."""
from __future__ import annotations

from harness.mutants.base import Mutant
from runners.attention import torch_planned
from runners.attention.flashinfer_plan import GraphBatches, WrapperSet
from runners.attention.torch_planned import TorchPlannedAttnBackend
from runners.base_cuda_graph_runner import BaseCudaGraphRunner


def _replay_not_planned(self: TorchPlannedAttnBackend, fb) -> None:
    self.graph_batches.require(fb, "torch_planned: a replay plan")  # and nothing else: the warm-up's plan stands


def _key_by_shape(fb, req_to_token, num_qo_heads: int):
    return (fb.forward_mode, fb.batch_size, tuple(fb.extend_seq_lens_cpu), num_qo_heads)  # what was written is not asked


def _every_pass_graph(self: GraphBatches, fb) -> WrapperSet:
    return WrapperSet.GRAPH


def _bucket_not_named(self: BaseCudaGraphRunner, fb) -> None:
    return None  # the backend never hears of the bucket's batch


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "host-plan-capture-lengths",
        "the replay plan never runs: every replay of a host-planned backend reads the indptrs its warm-up planned from "
        "the capture-time batch (every lane at the fill seq_len), not the replay's own buffers",
        "host plan from the capture-time batch",
        ((TorchPlannedAttnBackend, "init_forward_metadata_replay_cuda_graph", _replay_not_planned),),
        ("planned-cases:tp1_planned_single_layer", "planned-cases"),  # P3, P4
    ),
    Mutant(
        "host-plan-key-by-shape",
        "the replay plan is skipped whenever the bucket's batch has the shape of the last replay plan (mode, size, "
        "extend lengths), not only when nothing it reads was written since: a bucket replayed again in a later iteration "
        "keeps the earlier iteration's lengths (flashinfer's backend keys its skip by the same plan_inputs_key)",
        "host plan from stale buffers",
        ((torch_planned, "plan_inputs_key", _key_by_shape),),
        ("planned-cases:tp1_planned_single_layer", "planned-cases"),  # P3, P4
    ),
    Mutant(
        "host-plan-eager-on-graph-wrappers",
        "eager passes plan the graph buckets' wrappers, whose row count the bucket's first plan fixed: a prompt prefill "
        "of more rows than a bucket of its batch size holds is refused (flashinfer's cuda-graph mode refuses it the same "
        "way), so the loop cannot run; SGLang keeps its eager wrappers apart",
        "eager pass on a graph's wrapper",
        ((GraphBatches, "wrapper_set", _every_pass_graph),),
        ("planned-loop",),  # run: the prefill's plan is refused
    ),
    Mutant(
        "graph-runner-unnamed-bucket",
        "a graph runner captures without naming its bucket's batch to the attention backend first "
        "(init_forward_metadata_capture_cuda_graph): a host-planned backend plans the warm-ups on an eager wrapper, "
        "which a capture cannot use (its buffers are the plan's, not fixed), and refuses the capture",
        "eager pass on a graph's wrapper",
        ((BaseCudaGraphRunner, "init_capture_metadata", _bucket_not_named),),
        ("planned-cases:tp1_planned_single_layer", "planned-cases"),  # run: the capture is refused
    ),
)
