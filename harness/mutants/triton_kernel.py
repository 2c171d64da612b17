"""Mutants inside the triton backend's kernels (runners.attention.triton_backend), seen by P2 on the shipped triton
case (harness.props.backend_probes): on CPU the kernels run in Triton's interpreter, which calls a kernel's helper
through its module at every launch, so a mutant replaces the helper there."""
from __future__ import annotations

import importlib
from typing import Any

from harness.mutants.base import Mutant, Wrap

_BACKEND = "runners.attention.triton_backend"  # imports triton, an optional package: named here, imported when planted


def _unmasked_values(real: Any) -> Any:
    return importlib.import_module("harness.mutants.triton_blocks").kv_block_unmasked_values  # imports triton


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "triton-values-past-seq-len",
        "the triton kernels load the values of every key of a block, past the lane's seq_len too, where the slot read "
        "defaults to slot 0, the padding slot the padded lanes write: the masked key's probability is 0, but 0 * NaN is "
        "NaN, so a padded lane's KV reaches the real rows (finite there unless poisoned: P3 and P4 cannot see it)",
        "padded lane read in a kernel",
        ((_BACKEND, "_kv_block", Wrap(_unmasked_values)),),
        ("padded-lanes-triton",),  # P2
    ),
)
