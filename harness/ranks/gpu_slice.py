"""Slicing GPUs and TCP ports over pytest-xdist workers, so that `pytest -n N` never has two
workers' ranks on one GPU or one rendezvous port.

Each worker gets a contiguous, balanced slice of the visible GPUs (8 GPUs over 3 workers:
[0,1,2], [3,4,5], [6,7]); with more workers than GPUs the first ones get one GPU each and
the rest none (their multi-GPU tests skip: run those with few workers, or -p no:xdist).
Ports: worker w owns [PORT_BASE + PORT_SPAN*w, PORT_BASE + PORT_SPAN*(w+1)).

The pure functions (gpu_slice, cuda_visible_devices_for_worker, port_range) take the
worker, worker count and device count explicitly so they can be tested on a CPU machine;
the rest read PYTEST_XDIST_WORKER / PYTEST_XDIST_WORKER_COUNT and torch.cuda.
"""
from __future__ import annotations

import os
import re
import socket
from typing import Mapping, Optional

PORT_BASE = 29500
PORT_SPAN = 200
SLICE_ENV = "SPECHARNESS_GPU_SLICE"  # set by apply_worker_slice: CUDA_VISIBLE_DEVICES already holds this worker's slice


def _env(environ: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def worker_index(environ: Optional[Mapping[str, str]] = None) -> int:
    """This xdist worker's index ("gw3" -> 3); 0 when not under xdist."""
    m = re.fullmatch(r"\s*[A-Za-z]*(\d+)\s*", _env(environ).get("PYTEST_XDIST_WORKER", ""))
    return int(m.group(1)) if m else 0


def worker_count(environ: Optional[Mapping[str, str]] = None) -> int:
    """Number of xdist workers; 1 when not under xdist."""
    try:
        return max(1, int(_env(environ).get("PYTEST_XDIST_WORKER_COUNT", "1")))
    except ValueError:
        return 1


def port_range(worker: Optional[int] = None) -> range:
    """TCP ports owned by `worker` (default: this worker); disjoint across workers."""
    w = worker_index() if worker is None else worker
    if w < 0:
        raise ValueError(f"worker index must be >= 0 (got {w})")
    lo = PORT_BASE + PORT_SPAN * w
    if lo + PORT_SPAN > 65536:
        raise ValueError(f"worker {w}: port range {lo}..{lo + PORT_SPAN} is past 65535")
    return range(lo, lo + PORT_SPAN)


def free_port(worker: Optional[int] = None, host: str = "127.0.0.1") -> int:
    """The first port of this worker's range that can be bound now (a probe: it may be taken later)."""
    for port in port_range(worker):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {port_range(worker)}")


def gpu_slice(worker: int, n_workers: int, device_count: int) -> list[int]:
    """Device indices of `worker`'s contiguous share of `device_count` GPUs over `n_workers` workers."""
    if n_workers < 1:
        raise ValueError(f"n_workers must be >= 1 (got {n_workers})")
    if not 0 <= worker < n_workers:
        raise ValueError(f"worker must be in 0..{n_workers - 1} (got {worker})")
    if device_count < 0:
        raise ValueError(f"device_count must be >= 0 (got {device_count})")
    base, extra = divmod(device_count, n_workers)
    start = worker * base + min(worker, extra)
    return list(range(start, start + base + (1 if worker < extra else 0)))


def cuda_visible_devices_for_worker(
    worker: Optional[int] = None,
    n_workers: Optional[int] = None,
    device_count: Optional[int] = None,
    parent_visible: Optional[str] = None,
) -> str:
    """CUDA_VISIBLE_DEVICES for `worker`'s slice ("" = no GPU).

    parent_visible: the CUDA_VISIBLE_DEVICES the worker inherited (None: the environment's);
    when set, slice indices are mapped through it (it may hold UUIDs) and device_count
    defaults to its length.
    """
    w = worker_index() if worker is None else worker
    k = worker_count() if n_workers is None else n_workers
    if parent_visible is None:
        parent_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    parent = [d.strip() for d in parent_visible.split(",") if d.strip()] if parent_visible is not None else None
    if device_count is None:
        device_count = len(parent) if parent is not None else _device_count_without_init()
    ids = gpu_slice(w, k, device_count)
    if parent is not None:
        if device_count > len(parent):
            raise ValueError(f"device_count {device_count} > the {len(parent)} devices of CUDA_VISIBLE_DEVICES={parent_visible!r}")
        return ",".join(parent[i] for i in ids)
    return ",".join(str(i) for i in ids)


def apply_worker_slice(environ: Optional[dict[str, str]] = None, device_count: Optional[int] = None) -> str:
    """Restrict this process's CUDA_VISIBLE_DEVICES to the worker's slice; returns the new value.

    Call before CUDA is initialised (e.g. in a conftest's pytest_configure on xdist workers).
    Idempotent: SLICE_ENV marks an applied slice, after which worker_gpus() is simply every
    visible device.
    """
    env = os.environ if environ is None else environ
    if SLICE_ENV in env:
        return env.get("CUDA_VISIBLE_DEVICES", "")
    value = cuda_visible_devices_for_worker(
        worker_index(env), worker_count(env), device_count, parent_visible=env.get("CUDA_VISIBLE_DEVICES")
    )
    env["CUDA_VISIBLE_DEVICES"] = value
    env[SLICE_ENV] = f"gw{worker_index(env)}/{worker_count(env)}:{value}"
    return value


def worker_gpus(device_count: Optional[int] = None, environ: Optional[Mapping[str, str]] = None) -> list[int]:
    """CUDA device indices (as this process numbers them) that this worker may use."""
    env = _env(environ)
    n = _visible_device_count() if device_count is None else device_count
    if SLICE_ENV in env:
        return list(range(n))
    return gpu_slice(worker_index(env), worker_count(env), n)


def require_gpus(n: int, device_count: Optional[int] = None, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """None if this worker's slice has at least n GPUs, else a skip reason."""
    env = _env(environ)
    total = _visible_device_count() if device_count is None else device_count
    mine = worker_gpus(total, env)
    if len(mine) >= n:
        return None
    where = f"xdist worker gw{worker_index(env)} of {worker_count(env)}" if "PYTEST_XDIST_WORKER" in env else "this process"
    return f"needs {n} GPU(s) in this worker's slice: {where} has {len(mine)} ({mine}) of {total} visible"


def _visible_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _device_count_without_init() -> int:
    """GPU count via NVML where possible (does not initialise CUDA, so CUDA_VISIBLE_DEVICES can still change)."""
    import torch

    nvml = getattr(torch.cuda, "_device_count_nvml", None)
    if nvml is not None:
        try:
            n = nvml()
            if n >= 0:
                return n
        except Exception:  # noqa: BLE001 - any NVML trouble: fall back
            pass
    return _visible_device_count()
