"""Mutants of the graph runners' host mirrors (seq_lens_cpu, the verify's custom_mask_cpu): what a host-planned
backend (flashinfer, torch_planned) plans a replay with instead of reading the device buffers back. P1 sees a stale
mirror on every case (the replay record's host mirror against the device buffers); where live lanes get a stale
length, the torch_planned cases (probes planned-cases, planned-loop) see the plan for other lengths than the graph reads (P3), as
flashinfer's on a GPU. A stale padded lane's plan is harmless to the real rows there: the lanes' key ranges follow
each other, the padded ones last."""
from __future__ import annotations

from harness.mutants.base import Mutant, keeps
from runners.decode_cuda_graph_runner import DecodeCudaGraphRunner
from runners.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
from runners.eagle_draft_extend_cuda_graph_runner import EAGLEDraftExtendCudaGraphRunner
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import MultiLayerEagleDraftExtendCudaGraphRunner


def _keeps_host(runner: type, method: str, mirror: str = "seq_lens_cpu"):
    """runner.method with its writes to the host mirror undone: the mirror keeps the previous replay's values while
    the device buffer gets the new ones."""
    return runner, method, keeps(getattr(runner, method), mirror)


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "draft-extend-host-seq-lens-not-copied",
        "draft-extend replay copy-in writes the live seq_lens to the device buffer but not to its host mirror: a host-planned backend plans every live lane with the fill length",
        "host metadata out of step with the device",
        (_keeps_host(MultiLayerEagleDraftExtendCudaGraphRunner, "_copy_live_inputs"),),
        ("metadata-dp", "metadata-grid", "planned-cases"),  # P1 (host mirror); P3, P4 (torch_planned plans the stale lengths)
    ),
    Mutant(
        "verify-host-seq-lens-stale-padded",
        "TARGET_VERIFY replay fill resets the padded lanes' seq_lens on the device but not in the host mirror: after the batch shrinks, a host-planned backend plans them with the larger batch's lengths",
        "stale padded lane after shrink",
        (_keeps_host(DecodeCudaGraphRunner, "_fill_padded_lanes"),),
        ("metadata-dp", "metadata-grid"),  # P1 (host mirror)
    ),
    Mutant(
        "single-layer-host-seq-lens-not-copied",
        "the single-layer draft-extend runner's replay fill writes seq_lens to the device buffer but not to its host mirror",
        "host metadata out of step with the device",
        (_keeps_host(EAGLEDraftExtendCudaGraphRunner, "_fill_for_replay"),),
        ("metadata-dp", "metadata-grid"),  # P1 (host mirror)
    ),
    Mutant(
        "decode-host-seq-lens-not-copied",
        "the draft-decode replay copy-in writes seq_lens to the device buffer but not to its host mirror: a host-planned backend plans every step with the last replay's lengths",
        "host metadata out of step with the device",
        (_keeps_host(EAGLEDraftCudaGraphRunner, "_copy_live_inputs"),),
        ("metadata-dp", "metadata-grid"),  # P1 (host mirror)
    ),
    Mutant(
        "decode-host-seq-lens-stale-padded",
        "the draft-decode replay fill resets the padded lanes' seq_lens on the device but not in the host mirror",
        "stale padded lane after shrink",
        (_keeps_host(EAGLEDraftCudaGraphRunner, "_fill_padded_lanes"),),
        ("metadata-dp", "metadata-grid"),  # P1 (host mirror)
    ),
    Mutant(
        "verify-host-seq-lens-not-copied",
        "the TARGET_VERIFY replay copy-in writes seq_lens to the device buffer but not to its host mirror",
        "host metadata out of step with the device",
        (_keeps_host(DecodeCudaGraphRunner, "_copy_live_inputs"),),
        ("metadata-dp", "metadata-grid", "planned-loop"),  # P1 (host mirror); P3, P5 (the verify replays torch_planned plans stale)
    ),
    Mutant(
        "verify-host-mask-stale-padded",
        "TARGET_VERIFY replay fill resets the padded lanes' tree masks to the chain mask on the device but not in the host mirror: after a tree batch shrinks within its bucket, a host-planned backend plans them with the larger batch's trees",
        "stale padded lane after shrink",
        (_keeps_host(DecodeCudaGraphRunner, "_fill_padded_lanes", "custom_mask_cpu"),),
        ("metadata-dp", "metadata-grid"),  # P1 (host mirror): both probes shrink a tree batch within its bucket
    ),
    Mutant(
        "draft-extend-host-seq-lens-stale-padded",
        "the multi-layer draft-extend reset fills seq_lens of the padded lanes on the device but not in the host mirror",
        "stale padded lane after shrink",
        (_keeps_host(MultiLayerEagleDraftExtendCudaGraphRunner, "reset_for_iteration"),),
        ("metadata-dp", "metadata-grid"),  # P1 (host mirror)
    ),
)
