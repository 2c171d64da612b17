"""Host mirrors: the tensors that live in host memory on a GPU (seq_lens_cpu, custom_mask_cpu, a plan's lengths).

On a GPU an op on host tensors runs on the CPU when it is issued; a CUDA graph capture does not record it, so
whatever the body derived from a host tensor during capture is frozen into the graph, and a replay never
re-reads the mirror. On CPU every tensor is a host tensor, so the recording CPU graph (runners.graph.record)
cannot tell a host mirror from a device buffer by its device: the runners mark their mirrors here, and the
recorder runs ops on marked tensors at capture only, as a GPU capture does.

A mark is kept by storage, so every view of a marked tensor (the batch's `seq_lens_cpu[:bs]`) is a host
tensor too; it lasts as long as that memory does.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_leaves

_lock = threading.RLock()  # re-entrant: a mark dropped under the lock may run its own `forget`
_marked: dict[int, weakref.ref] = {}  # storage address -> the storage (dead: the address is free again)


def host_mirror(t: torch.Tensor) -> torch.Tensor:
    """Marks `t`'s storage (memory that lives on the host on a GPU) and returns `t`."""
    if t.device.type != "cpu":
        raise ValueError(f"a host mirror lives in host memory; got a tensor on {t.device}")
    storage = t.untyped_storage()
    key = storage.data_ptr()
    if key == 0:
        return t  # no memory (an empty tensor): nothing can read it

    def forget(ref: weakref.ref, key: int = key) -> None:
        with _lock:
            if _marked.get(key) is ref:
                del _marked[key]

    with _lock:
        held = _marked.get(key)
        if held is None or held() is not storage:
            _marked[key] = weakref.ref(storage, forget)
    return t


def is_host_mirror(t: torch.Tensor) -> bool:
    """Whether `t` is a view of marked host memory."""
    if not _marked or t.device.type != "cpu":
        return False
    storage = t.untyped_storage()
    held = _marked.get(storage.data_ptr())
    return held is not None and held() is storage


def host_mirrors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The host mirrors among `tensors`, in order: is_host_mirror of each, for the recorder's every op. The device test
    is left to the identity test (a marked storage is a CPU storage, so no other device's storage is it)."""
    if not _marked:
        return []
    out = []
    for t in tensors:
        storage = t.untyped_storage()
        held = _marked.get(storage.data_ptr())
        if held is not None and held() is storage:
            out.append(t)
    return out


# ---- a device op that takes host tensors, inside a capture ----

_COPIES = (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default, torch.ops.aten._copy_from.default)


def _written(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op writes in place (its schema's mutable arguments, out= included)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
            out.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return out


def host_device_mix(func: torch._ops.OpOverload, args: tuple, kwargs: dict, host: list[torch.Tensor]) -> Optional[str]:
    """What is wrong with a device op that takes these host tensors, or None: a 0-dim host tensor it only reads is a
    kernel argument (a CUDA kernel takes a CPU scalar, read at launch); any other mix is a host-device copy."""
    written = {id(t) for t in _written(func, args, kwargs)}
    bad: Any = next((t for t in host if t.dim() != 0 or id(t) in written), None)
    if bad is None and func not in _COPIES:
        return None
    t = bad if bad is not None else host[0]
    what = "writes" if id(t) in written else "copies" if func in _COPIES else "reads"
    return f"{func} {what} host memory {tuple(t.shape)} (a host mirror) together with device tensors: a host-device copy"
