"""The attention backends a run can name, as SGLang's --attention-backend names them."""
from __future__ import annotations

from enum import StrEnum


class AttentionBackend(StrEnum):
    TORCH = "torch"  # the reference: plain torch ops, any device
    TRITON = "triton"  # SGLang's triton kernels (CPU through the triton interpreter, or a GPU)
    FLASHINFER = "flashinfer"  # FlashInfer's wrappers; a CUDA GPU only
