"""The replay copy-in of a graph runner's live inputs, grouped as the engine groups it.

A replay's small per-field copies cost a launch each on the host, more than the copies cost on
the device; the engine (SGLang's `_grouped_foreach_copy_`) gives each (destination dtype,
source dtype) pair one `torch._foreach_copy_`. Large contiguous buffers (hidden states) stay
plain copies there, on the copy engine, and here too: the callers copy them apart.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

_GroupKey = tuple[torch.dtype, torch.dtype, torch.device, torch.device]


def grouped_foreach_copy_(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """dst.copy_(src) for every pair (broadcasting as copy_ does), one foreach call per (dtypes, devices) group."""
    groups: dict[_GroupKey, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for dst, src in zip(dsts, srcs, strict=True):
        group = groups.setdefault((dst.dtype, src.dtype, dst.device, src.device), ([], []))
        group[0].append(dst)
        group[1].append(src)
    for group_dsts, group_srcs in groups.values():
        torch._foreach_copy_(group_dsts, group_srcs)
