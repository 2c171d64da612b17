"""The attention backends a run can name, as SGLang's --attention-backend names them."""
from __future__ import annotations

from enum import StrEnum


class AttentionBackend(StrEnum):
    TORCH = "torch"  # the reference: plain torch ops, any device
    TRITON = "triton"  # SGLang's triton kernels (CPU through the triton interpreter, or a GPU)
    FLASHINFER = "flashinfer"  # FlashInfer's wrappers; a CUDA GPU only
    TORCH_PLANNED = "torch_planned"  # flashinfer's shape in torch ops (planned on the host per pass and replay), any device


# What the flashinfer backend refuses, here rather than in its module: the loop's harness names it without importing
# the backend, which (like every backend but the reference) is imported only when one is built.
TREE_MASK_UNSUPPORTED = ("the flashinfer backend does not apply the verify tree mask (a TARGET_VERIFY batch's custom_mask): "
                         "the speculative loop verifies with the torch or triton backend")

# The backends whose draft-extend attention metadata is built inside the graph (device tensors the body computes), so
# one graph can run every draft step: flashinfer and torch_planned plan each replay on the host, per step. SGLang's worker builds its
# one-graph composite only for backends that refresh that metadata in the graph or stage it (FA3), and the per-step
# one for the others (flashinfer, triton: ours computes it on the device).
METADATA_IN_GRAPH = frozenset({AttentionBackend.TORCH, AttentionBackend.TRITON})
ONE_GRAPH_UNSUPPORTED = ("the one-graph draft-extend composite needs an attention backend whose metadata is built inside the "
                         "graph (torch, triton): flashinfer and torch_planned plan each step on the host before its replay, and "
                         "SGLang's worker builds the per-step composite for such a backend")
RAGGED_UNSUPPORTED = ("the ragged draft-extend needs an attention backend whose metadata is built inside the graph (torch, "
                      "triton): its lanes' extents change with every replay's accepted tokens, and a host-planned backend's "
                      "graph would keep the extents of its capture (vLLM plans its FlashInfer wrappers per replay)")
