"""The attention backends a run can name, as SGLang's --attention-backend names them."""
from __future__ import annotations

from enum import StrEnum


class AttentionBackend(StrEnum):
    TORCH = "torch"  # the reference: plain torch ops, any device
    TRITON = "triton"  # SGLang's triton kernels (CPU through the triton interpreter, or a GPU)
    FLASHINFER = "flashinfer"  # FlashInfer's wrappers; a CUDA GPU only


# What the flashinfer backend refuses, here rather than in its module: the loop's harness names it without importing
# the backend, which (like every backend but the reference) is imported only when one is built.
TREE_MASK_UNSUPPORTED = ("the flashinfer backend does not apply the verify tree mask (a TARGET_VERIFY batch's custom_mask): "
                         "the speculative loop verifies with the torch or triton backend")
