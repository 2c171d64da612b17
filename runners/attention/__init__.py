"""Attention backends behind one interface (torch reference; triton; flashinfer on GPU; torch_planned, flashinfer's
host-planned shape in torch ops).

Every backend is built as `make_backend(name, req_pool=..., kv_pool=...)` and has
`init_forward_metadata(fb) -> meta` and `forward(layer, q, k, v, fb, meta) -> o`; the single-layer
draft decode's step s builds its metadata with `init_draft_decode_metadata(fb, locs, s)` (locs:
every lane's draft KV slots, [bs, topk, steps]) and attends through the same `forward`: a backend
without it is refused when such a draft is built (runners.eagle_draft.require_draft_decode). A backend
that plans on the host (flashinfer) also has `init_forward_metadata_replay_cuda_graph(fb)`,
which the graph runner calls before each replay with the bucket's batch (its tensors hold
the live values by then), as the engine's runners do, and `init_forward_metadata_capture_cuda_graph(fb)`, which a
graph runner calls with each bucket's batch before its warm-ups (runners.attention.flashinfer_plan.GraphBatches).

Registration is cheap: "triton" is listed when the package is installed, "flashinfer"
when it is installed and CUDA is available; their modules (and the packages) are imported
only when a backend is built.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Callable

from runners.attention.torch_ref import TorchAttnBackend


def _lazy(module: str, cls: str) -> Callable:
    def build(**kw):
        return getattr(importlib.import_module(module), cls)(**kw)

    build.__name__ = cls
    return build


def _installed(pkg: str) -> bool:
    try:
        return importlib.util.find_spec(pkg) is not None
    except (ImportError, ValueError):
        return False


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


BACKENDS: dict[str, Callable] = {"torch": TorchAttnBackend, "torch_planned": _lazy("runners.attention.torch_planned", "TorchPlannedAttnBackend")}
if _installed("triton"):
    BACKENDS["triton"] = _lazy("runners.attention.triton_backend", "TritonAttnBackend")
if _installed("flashinfer") and _cuda():
    BACKENDS["flashinfer"] = _lazy("runners.attention.flashinfer_backend", "FlashInferAttnBackend")


def unavailable_reason(name: str) -> str | None:
    """Why a known backend is not registered here (for skips and error messages)."""
    if name in BACKENDS:
        return None
    if name == "triton":
        return "triton is not installed (pip install triton==3.6.0)"
    if name == "flashinfer":
        if not _installed("flashinfer"):
            return "flashinfer is not installed (the optional extra: pip install .[gpu])"
        return "flashinfer needs a CUDA GPU: torch.cuda.is_available() is False"
    return f"unknown attention backend {name!r}"


def make_backend(name: str, **kw):
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not available here ({unavailable_reason(name)}); known: {sorted(BACKENDS)}")
    return BACKENDS[name](**kw)
