"""Mutants of a graph runner's capture-time forward batch: a field the replay writes that get_forward_batch leaves at its
default or builds otherwise than the replay writes it (another dtype or shape, a tensor of its own instead of the
static buffer). Each one is the bug class I1 over every field exists for (harness.props.p1_fields): the counts I1
compared before agree under every one of them, and P1 on one DP layout kills each by the field's name."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from harness.mutants.base import Mutant, Wrap
from runners.batch import ForwardBatch
from runners.decode_cuda_graph_runner import DecodeCudaGraphRunner
from runners.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
from runners.eagle_draft_extend_cuda_graph_runner import EAGLEDraftExtendCudaGraphRunner
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import MultiLayerEagleDraftExtendCudaGraphRunner
from runners.parallel.layout import DpPaddingMode

KIND = "capture field otherwise than the replay writes it"
DEFAULTS = {f.name: f.default for f in dataclasses.fields(ForwardBatch) if f.default is not dataclasses.MISSING}


def _rebuilt(change: Callable[[Any, ForwardBatch], dict[str, Any]]) -> Wrap:
    """get_forward_batch whose batch has the fields `change(runner, fb)` names replaced."""

    def make(real: Callable[[Any, int], ForwardBatch]) -> Callable[[Any, int], ForwardBatch]:
        def get_forward_batch(self: Any, bs: int) -> ForwardBatch:
            fb = real(self, bs)
            return dataclasses.replace(fb, **change(self, fb))

        return get_forward_batch

    return Wrap(make)


PROBES = ("metadata-dp",)  # P1 (I1 over every field)

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "capture-seq-lens-sum-default",
        "the multi-layer draft-extend's get_forward_batch leaves seq_lens_sum at its default (0), which the replay sets "
        "from the live lanes: a backend that sizes its plan by the sum at capture bakes an empty one",
        KIND,
        ((MultiLayerEagleDraftExtendCudaGraphRunner, "get_forward_batch", _rebuilt(lambda r, fb: {"seq_lens_sum": DEFAULTS["seq_lens_sum"]})),),
        PROBES,
    ),
    Mutant(
        "single-layer-capture-extend-num-tokens-default",
        "the single-layer draft-extend's get_forward_batch leaves extend_num_tokens at its default (0) where the replay's "
        "extents sum to bs * T",
        KIND,
        ((EAGLEDraftExtendCudaGraphRunner, "get_forward_batch", _rebuilt(lambda r, fb: {"extend_num_tokens": DEFAULTS["extend_num_tokens"]})),),
        PROBES,
    ),
    Mutant(
        "verify-capture-padding-mode-sum-len",
        "the TARGET_VERIFY get_forward_batch bakes DP padding mode SUM_LEN while every replay pads each DP group to the "
        "bucket (MAX_LEN): equal counts make the two buffers one size, so no count differs",
        KIND,
        ((DecodeCudaGraphRunner, "get_forward_batch", _rebuilt(lambda r, fb: {"dp_padding_mode": DpPaddingMode.SUM_LEN})),),
        PROBES,
    ),
    Mutant(
        "decode-capture-seq-lens-cpu-copy",
        "the draft decode's get_forward_batch hands its batch a copy of the seq_lens host mirror: the replay writes the "
        "mirror, and a host-planned backend re-plans every replay from the copy, frozen at capture",
        KIND,
        ((EAGLEDraftCudaGraphRunner, "get_forward_batch", _rebuilt(lambda r, fb: {"seq_lens_cpu": fb.seq_lens_cpu.clone()})),),
        PROBES,
    ),
    Mutant(
        "multi-layer-capture-positions-int32",
        "the multi-layer draft-extend's get_forward_batch builds positions as an int32 tensor of its own: the graph reads "
        "the capture-time positions, never the replay's",
        KIND,
        ((MultiLayerEagleDraftExtendCudaGraphRunner, "get_forward_batch", _rebuilt(lambda r, fb: {"positions": fb.positions.to(torch.int32)})),),
        PROBES,
    ),
    Mutant(
        "single-layer-capture-req-pool-indices-unsliced",
        "the single-layer draft-extend's get_forward_batch hands its batch the whole req_pool_indices buffer (max_bs "
        "lanes) where the replay writes the bucket's bs",
        KIND,
        ((EAGLEDraftExtendCudaGraphRunner, "get_forward_batch", _rebuilt(lambda r, fb: {"req_pool_indices": r.buffers.req_pool_indices})),),
        PROBES,
    ),
)
