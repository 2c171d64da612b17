"""Spawning real ranks: `launch(layout, fn, *args)` runs `fn(comm, *args)` on every rank of the
layout, each in a fresh process, and returns every rank's result and collective trace.

When torchrun or srun started this process as one rank of a world (harness.ranks.joined),
launch runs fn on those processes instead of spawning any: everything below is the spawned
case. The parent's side lives in harness.ranks.supervisor, the child's in harness.ranks.child.

Hang-proof:
* The parent supervises: it never blocks on a child. Every rank keeps a heartbeat file
  (harness.ranks.heartbeat) saying which collective it is in; on a timeout the parent
  raises DistributedTimeout listing every rank's state (``rank 1: stuck in all_reduce(...)
  [collective #3, entered]``, ``rank 0: finished``).
* Deadlocks are reported at once, without waiting for the timeout: a rank stuck in a
  collective whose group holds a rank that has already returned from fn (having made
  fewer calls on that group) can never finish (DistributedDeadlock).
* A rank that raises ends the launch after `failure_grace_s` (DistributedRankFailure, with
  every failed rank's traceback and the others' heartbeat states); collective-signature
  mismatches come back as DistributedMismatch (a CollectiveMismatch).
* Orphans: every child is terminated, then killed, then joined in a finally (also on
  KeyboardInterrupt). Children also die by themselves when the parent vanishes: a lifeline
  pipe (a thread exits the child on EOF) and PR_SET_PDEATHSIG on Linux.

Rendezvous: a torch.distributed.FileStore in a fresh temp dir per launch (no ports, so no
port races under pytest -n auto; gloo's pairs then bind ephemeral ports on loopback).

Results travel back by plain pickle over a pipe (by value; CUDA tensors are moved to the
cpu first); fn and args travel to the children the same way, so fn must be a module-level
function and args picklable. A rank may skip with RankSkip("why") (or pytest.skip):
the child exits with SKIP_EXIT_CODE and the parent raises LaunchSkipped(reason).

Start method: gloo ranks fork from the process's forkserver (harness.ranks.forkserver), which has
imported torch and the child module once; each child then installs its parent's environment.
nccl ranks are spawned: a fresh interpreter whose environment holds before anything touches the
CUDA driver.

Children's environment: the parent's, plus RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
OMP_NUM_THREADS=1, NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1, SPECHARNESS_HEARTBEAT_FILE, SPECHARNESS_PLANTED_MUTANTS (the mutants planted in
the parent, planted again in the child), GLOO_SOCKET_IFNAME=lo (gloo, unless
set), SPECHARNESS_CUDA_DEVICE (nccl: the rank's device, torch.cuda.set_device'd).
"""
from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import time
from typing import Any, Callable, Optional

from harness.mutants.base import PLANTED_ENV, planted_ids
from harness.ranks import forkserver
from harness.ranks.child import child_main
from harness.ranks.environ import patched_environ
from harness.ranks.gpu_slice import worker_gpus
from harness.ranks.heartbeat import HEARTBEAT_ENV
from harness.ranks.joined import current_world
from harness.ranks.outcomes import (  # noqa: F401 - the launch's outcomes, importable from here
    FAIL_EXIT_CODE,
    ORPHAN_EXIT_CODE,
    SKIP_EXIT_CODE,
    DistributedDeadlock,
    DistributedMismatch,
    DistributedRankFailure,
    DistributedTimeout,
    LaunchResult,
    LaunchSkipped,
    RankSkip,
)
from harness.ranks.supervisor import Supervisor
from runners.parallel.layout import ParallelLayout

ENV_ALWAYS = {
    "OMP_NUM_THREADS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
CUDA_DEVICE_ENV = "SPECHARNESS_CUDA_DEVICE"
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "harness.ranks.child")

def resolve_backend(backend: str, world_size: int) -> str:
    """"auto": nccl if this worker's GPU slice has >= world_size GPUs, else gloo."""
    b = backend.lower()
    if b not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be auto, gloo or nccl (got {backend!r})")
    if b == "gloo":
        return b
    gpus = _worker_gpus()
    if b == "auto":
        return "nccl" if len(gpus) >= world_size else "gloo"
    if len(gpus) < world_size:
        raise LaunchSkipped(f"backend nccl needs {world_size} GPUs in this worker's slice; it has {len(gpus)} ({gpus})")
    return b


def _worker_gpus() -> list[int]:
    import torch

    if not torch.cuda.is_available():
        return []

    return worker_gpus()


def child_env(rank: int, world_size: int, backend: str, heartbeat_path: str, cuda_device: Optional[int]) -> dict[str, str]:
    env = dict(ENV_ALWAYS)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    env[HEARTBEAT_ENV] = heartbeat_path
    env[PLANTED_ENV] = ",".join(planted_ids())  # the child plants them again (harness.ranks.child): it runs the parent's code
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    if cuda_device is not None:
        env[CUDA_DEVICE_ENV] = str(cuda_device)
    return env


def launch(
    layout: ParallelLayout,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = "auto",
    timeout_s: float = 60.0,
    startup_timeout_s: float = 180.0,
    failure_grace_s: float = 5.0,
    check_signatures: Optional[bool] = None,
) -> LaunchResult:
    """Run fn(comm, *args) on every rank of `layout` (a fresh process each) and collect the results.

    timeout_s counts from the moment every rank has joined the process group (spawning
    and importing torch can take many seconds on a loaded machine; startup_timeout_s
    bounds that). failure_grace_s: after a rank failed or skipped, how long the others may
    still finish before they are killed. check_signatures: see DistComm (None: on for gloo).
    """
    import torch.multiprocessing as tmp_mp

    world = current_world()
    if world is not None:  # started by torchrun / srun: the launched processes are the ranks
        return world.launch(layout, fn, *args, backend=backend, timeout_s=timeout_s, failure_grace_s=failure_grace_s,
                            check_signatures=check_signatures)
    ws = layout.world_size
    backend = resolve_backend(backend, ws)
    try:
        payload = pickle.dumps((fn, args))
    except Exception as e:
        raise TypeError(f"launch: fn and args must pickle (fn must be a module-level function): {e}") from e
    gpus = _worker_gpus() if backend == "nccl" else []
    ctx = tmp_mp.get_context("spawn") if backend == "nccl" else forkserver.context(FORKSERVER_PRELOAD)
    workdir = tempfile.mkdtemp(prefix="specharness-ranks-")
    store_path = os.path.join(workdir, "store")
    hb_paths = [os.path.join(workdir, f"heartbeat-{r}.json") for r in range(ws)]
    pg_timeout_s = timeout_s + startup_timeout_s + 60.0  # the children's own backstop; the parent acts first
    procs: list[Any] = []
    conns: list[Any] = []
    ctrls: list[Any] = []
    t0 = time.monotonic()
    try:
        for r in range(ws):
            recv_end, send_end = ctx.Pipe(duplex=False)
            ctrl_recv, ctrl_send = ctx.Pipe(duplex=False)
            dev = gpus[r] if backend == "nccl" else None
            own = child_env(r, ws, backend, hb_paths[r], dev)
            env = {**os.environ, **own}
            p = ctx.Process(
                target=child_main,
                args=(layout, r, backend, dev, store_path, hb_paths[r], env, payload, send_end, ctrl_recv,
                      os.getpid(), pg_timeout_s, check_signatures),  # fmt: skip
                name=f"specharness-rank{r}",
                daemon=False,  # fn may start processes of its own; we reap children ourselves
            )
            conns.append(recv_end)
            ctrls.append(ctrl_send)
            with patched_environ(own):  # a spawned child starts with it, before it imports torch
                p.start()
            procs.append(p)
            send_end.close()
            ctrl_recv.close()
        sup = Supervisor(layout, backend, procs, conns, hb_paths, timeout_s, startup_timeout_s, failure_grace_s)
        sup.run()
        elapsed = time.monotonic() - t0
        if sup.all_ok():
            for c in ctrls:
                _send_quietly(c, "exit")
            _join_all(procs, 30.0)
            return LaunchResult(
                results=[sup.outcomes[r][1] for r in range(ws)],
                traces=[sup.outcomes[r][2] for r in range(ws)],
                backend=backend,
                elapsed_s=elapsed,
                exit_codes=[p.exitcode for p in procs],
            )
        states = sup.states()
        for r, p in enumerate(procs):  # the unfinished first: a finished rank's exit must not wake them
            if r not in sup.outcomes and p.is_alive():
                p.terminate()
        for c in ctrls:
            _send_quietly(c, "abort")
        _join_all(procs, 5.0)  # those that reported exit by themselves (with their own exit code)
        _reap(procs)
        err = sup.error(states, elapsed)
        err.exit_codes = {r: p.exitcode for r, p in enumerate(procs)}
        raise err
    finally:
        _reap(procs)
        for c in conns + ctrls:
            try:
                c.close()
            except OSError:
                pass
        shutil.rmtree(workdir, ignore_errors=True)


def _send_quietly(conn: Any, msg: str) -> None:
    try:
        conn.send(msg)
    except (OSError, EOFError, ValueError):
        pass


def _join_all(procs: list[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))


def _reap(procs: list[Any], grace_s: float = 2.0) -> None:
    """Terminate, then kill, then join every child: none survives this."""
    alive = [p for p in procs if p.exitcode is None]
    for p in alive:
        if p.is_alive():
            p.terminate()
    _join_all(alive, grace_s)
    for p in alive:
        if p.is_alive():
            p.kill()
    for p in alive:
        p.join(10.0)
