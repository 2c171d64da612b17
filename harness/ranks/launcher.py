"""Spawning real ranks: `launch(layout, fn, *args)` runs `fn(comm, *args)` on every rank of the
layout, each in a fresh process, and returns every rank's result and collective trace.

Hang-proof:
* The parent supervises: it never blocks on a child. Every rank keeps a heartbeat file
  (harness.ranks.distributed) saying which collective it is in; on a timeout the parent
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

Children's environment: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
OMP_NUM_THREADS=1, NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1, SPECHARNESS_HEARTBEAT_FILE, GLOO_SOCKET_IFNAME=lo (gloo, unless
set), SPECHARNESS_CUDA_DEVICE (nccl: the rank's device, torch.cuda.set_device'd).
"""
from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait as mp_wait
from typing import Any, Callable, Iterator, Optional

from harness.ranks.distributed import HEARTBEAT_ENV, read_heartbeat, write_heartbeat
from harness.ranks.trace import CollectiveCall, CollectiveError, CollectiveMismatch, CollectiveTimeout
from runners.parallel.layout import ParallelLayout

SKIP_EXIT_CODE = 77  # a rank raised RankSkip
FAIL_EXIT_CODE = 1  # a rank raised
ORPHAN_EXIT_CODE = 75  # the parent vanished (lifeline closed)

ENV_ALWAYS = {
    "OMP_NUM_THREADS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
CUDA_DEVICE_ENV = "SPECHARNESS_CUDA_DEVICE"
POLL_S = 0.2  # how often the parent looks at heartbeats while some rank has finished


# ---------------------------------------------------------------------------------------
# outcomes
# ---------------------------------------------------------------------------------------


class RankSkip(Exception):
    """Raised inside a rank's fn: skip this launch (the parent raises LaunchSkipped)."""


class LaunchSkipped(Exception):
    """A rank skipped. Tests translate: ``except LaunchSkipped as e: pytest.skip(e.reason)``."""

    def __init__(self, reason: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.ranks = ranks
        self.exit_codes: dict[int, Optional[int]] = {}  # rank -> exit code (SKIP_EXIT_CODE for the skipped)


class DistributedTimeout(CollectiveTimeout):
    """Not every rank finished in time; the message lists every rank's state."""

    def __init__(self, message: str, states: Optional[dict[int, str]] = None) -> None:
        super().__init__(message)
        self.states = states or {}


class DistributedDeadlock(DistributedTimeout):
    """A rank waits in a collective for a rank that has already returned from fn."""


class DistributedRankFailure(CollectiveError):
    """One or more ranks raised (or died); `failures` maps rank -> traceback (or exit description)."""

    def __init__(self, message: str, failures: dict[int, str], states: Optional[dict[int, str]] = None) -> None:
        super().__init__(message)
        self.failures = failures
        self.states = states or {}


class DistributedMismatch(DistributedRankFailure, CollectiveMismatch):
    """Ranks called different collectives (detected by the signature exchange)."""


@dataclass
class LaunchResult:
    results: list[Any]  # results[rank]: what fn returned on that rank
    traces: list[list[CollectiveCall]]  # traces[rank]: that rank's collective calls
    backend: str
    elapsed_s: float = 0.0
    exit_codes: list[Optional[int]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------
# the parent side
# ---------------------------------------------------------------------------------------


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
    from harness.ranks.gpu_slice import worker_gpus

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
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    if cuda_device is not None:
        env[CUDA_DEVICE_ENV] = str(cuda_device)
    return env


_environ_lock = threading.Lock()


@contextmanager
def _patched_environ(env: dict[str, str]) -> Iterator[None]:
    """The child's env in os.environ while it is spawned (so it holds before the child imports torch)."""
    with _environ_lock:
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


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

    ws = layout.world_size
    backend = resolve_backend(backend, ws)
    try:
        payload = pickle.dumps((fn, args))
    except Exception as e:
        raise TypeError(f"launch: fn and args must pickle (fn must be a module-level function): {e}") from e
    gpus = _worker_gpus() if backend == "nccl" else []
    ctx = tmp_mp.get_context("spawn")
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
            env = child_env(r, ws, backend, hb_paths[r], dev)
            p = ctx.Process(
                target=_child_main,
                args=(layout, r, backend, dev, store_path, hb_paths[r], env, payload, send_end, ctrl_recv,
                      os.getpid(), pg_timeout_s, check_signatures),  # fmt: skip
                name=f"specharness-rank{r}",
                daemon=False,  # fn may start processes of its own; we reap children ourselves
            )
            conns.append(recv_end)
            ctrls.append(ctrl_send)
            with _patched_environ(env):
                p.start()
            procs.append(p)
            send_end.close()
            ctrl_recv.close()
        sup = _Supervisor(layout, backend, procs, conns, hb_paths, timeout_s, startup_timeout_s, failure_grace_s)
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


class _Supervisor:
    """Reads every child's messages and exits, and decides when the launch is over."""

    def __init__(self, layout, backend, procs, conns, hb_paths, timeout_s, startup_timeout_s, grace_s) -> None:
        self.layout, self.backend = layout, backend
        self.ws = layout.world_size
        self.procs, self.conns, self.hb_paths = procs, conns, hb_paths
        self.timeout_s, self.startup_timeout_s, self.grace_s = timeout_s, startup_timeout_s, grace_s
        self.ready: set[int] = set()
        self.outcomes: dict[int, tuple[str, Any, list]] = {}  # rank -> (status, payload, trace)
        self.dead: dict[int, Optional[int]] = {}  # rank -> exit code, for a child gone without an outcome
        self.closed: set[int] = set()
        self.reason = ""  # "timeout" | "startup" | "deadlock" | "grace" | "" (all done)
        self.deadlock: Optional[tuple[int, int, int]] = None
        self.t0 = time.monotonic()
        self.t_all_ready: Optional[float] = None

    # ---- the loop ----
    def run(self) -> None:
        first_bad: Optional[float] = None
        while True:
            pending = [r for r in range(self.ws) if r not in self.outcomes and r not in self.dead]
            if not pending:
                return
            now = time.monotonic()
            if self.t_all_ready is None and len(self.ready) == self.ws:
                self.t_all_ready = now
            if first_bad is None and (self.dead or any(o[0] != "ok" for o in self.outcomes.values())):
                first_bad = now
            if self.t_all_ready is None:
                deadline, why = self.t0 + self.startup_timeout_s, "startup"
            else:
                deadline, why = self.t_all_ready + self.timeout_s, "timeout"
            if first_bad is not None and first_bad + self.grace_s < deadline:
                deadline, why = first_bad + self.grace_s, "grace"
            if now >= deadline:
                self.reason = why
                return
            if self.outcomes and first_bad is None:
                found = self._find_deadlock(pending)
                if found:
                    self.deadlock, self.reason = found, "deadlock"
                    return
            waitables = {}
            for r in pending:
                if r not in self.closed:
                    waitables[self.conns[r]] = ("conn", r)
                waitables[self.procs[r].sentinel] = ("exit", r)
            poll = POLL_S if self.outcomes else 1.0
            for obj in mp_wait(list(waitables), timeout=min(deadline - now, poll)):
                kind, r = waitables[obj]
                if kind == "conn":
                    self._read(r)
                elif r not in self.outcomes:
                    while r not in self.closed and r not in self.outcomes and self.conns[r].poll():
                        self._read(r)  # it may have reported just before exiting
                    if r not in self.outcomes:
                        self.procs[r].join(1.0)
                        self.dead[r] = self.procs[r].exitcode

    def _read(self, r: int) -> None:
        try:
            data = self.conns[r].recv_bytes()
        except (EOFError, OSError):
            self.closed.add(r)
            return
        msg = _decode_message(data)
        if msg[0] == "ready":
            self.ready.add(r)
        else:
            _, status, payload, trace = msg
            self.outcomes[r] = (status, payload, trace)
            self.ready.add(r)

    def _find_deadlock(self, pending: list[int]) -> Optional[tuple[int, int, int]]:
        """(stuck rank, finished rank, its calls on the group) if a pending rank waits for a finished one."""
        finished = {r: o[2] for r, o in self.outcomes.items() if o[0] == "ok"}
        for r in pending:
            hb = read_heartbeat(self.hb_paths[r])
            if not hb or hb.get("state") != "entered":
                continue
            key = (hb.get("group"), tuple(hb.get("group_ranks", ())))
            for f in key[1]:
                if f in finished:
                    n = sum(1 for c in finished[f] if (c.group, tuple(c.group_ranks)) == key)
                    if n <= int(hb.get("group_seq", 0)):
                        return r, f, n
        return None

    # ---- reporting ----
    def all_ok(self) -> bool:
        return len(self.outcomes) == self.ws and all(o[0] == "ok" for o in self.outcomes.values())

    def states(self) -> dict[int, str]:
        """One line per rank: what it was doing when the launch ended."""
        out: dict[int, str] = {}
        for r in range(self.ws):
            hb = read_heartbeat(self.hb_paths[r])
            where = _where(hb)
            if r in self.outcomes:
                status, payload, _ = self.outcomes[r]
                if status == "ok":
                    out[r] = "finished"
                elif status == "skip":
                    out[r] = f"skipped: {payload}"
                else:
                    summary = "CollectiveMismatch (above)" if payload["mismatch"] else payload["summary"]
                    out[r] = f"failed: {summary}" + (f" (in {where})" if where else "")
            elif r in self.dead:
                out[r] = f"died without reporting: {_exit_text(self.dead[r])}" + (f" (last: {where})" if where else "")
            elif not hb or hb.get("state") == "starting":
                out[r] = "starting (process group not joined yet)"
            elif hb.get("state") == "entered":
                out[r] = f"stuck in {where}"
            elif hb.get("state") == "left":
                out[r] = f"running fn, outside collectives; last: {where}"
            else:
                out[r] = "running fn, no collective yet"
        return out

    def error(self, states: dict[int, str], elapsed: float) -> BaseException:
        ctx = f"{self.ws} ranks, backend {self.backend}, layout {self.layout.describe()}"
        lines = "\n".join(f"  rank {r}: {s}" for r, s in states.items())
        failures = {r: o[1]["traceback"] for r, o in self.outcomes.items() if o[0] == "error"}
        failures.update({r: f"exited without reporting: {_exit_text(c)}" for r, c in self.dead.items()})
        if failures:
            mismatches = [o[1]["message"] for o in self.outcomes.values() if o[0] == "error" and o[1]["mismatch"]]
            tbs = "\n".join(f"--- rank {r} ---\n{failures[r].rstrip()}" for r in sorted(failures))
            head = mismatches[0] if mismatches else f"rank(s) {', '.join(map(str, sorted(failures)))} failed"
            cls = DistributedMismatch if mismatches else DistributedRankFailure
            killed = [r for r in range(self.ws) if r not in self.outcomes and r not in self.dead]
            if killed:
                ctx += f"; rank(s) {', '.join(map(str, killed))} killed after the {self.grace_s:g} s grace"
            return cls(f"{head}\n({ctx})\n{lines}\n{tbs}", failures, states)
        skips = {r: o[1] for r, o in self.outcomes.items() if o[0] == "skip"}
        if skips:
            r0 = min(skips)
            more = f" (ranks {sorted(skips)} skipped)" if len(skips) > 1 else ""
            return LaunchSkipped(f"rank {r0}: {skips[r0]}{more}", tuple(sorted(skips)))
        if self.reason == "deadlock" and self.deadlock:
            r, f, n = self.deadlock
            return DistributedDeadlock(
                f"deadlock after {elapsed:.1f} s: rank {r} waits in a collective for rank {f}, which returned from fn "
                f"after {n} call(s) on that group\n({ctx})\n{lines}",
                states,
            )
        if self.reason == "startup":
            return DistributedTimeout(f"ranks did not all join the process group within {self.startup_timeout_s:g} s ({ctx})\n{lines}", states)
        return DistributedTimeout(
            f"timed out: not every rank finished within timeout_s={self.timeout_s:g} s of joining the process group "
            f"({elapsed:.1f} s in all; {ctx})\n{lines}",
            states,
        )


def _decode_message(data: bytes) -> tuple:
    return pickle.loads(data)


def _where(hb: Optional[dict]) -> str:
    if not hb or "call" not in hb:
        return ""
    return f"{hb['call']} [collective #{hb.get('seq')}, {hb.get('state')}]"


def _exit_text(code: Optional[int]) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# ---------------------------------------------------------------------------------------
# the child side
# ---------------------------------------------------------------------------------------


def _set_pdeathsig(parent_pid: int) -> None:
    """Linux: SIGKILL this process when its parent dies (a second line behind the lifeline)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except Exception:  # noqa: BLE001 - best effort
            pass
    if os.getppid() != parent_pid:
        os._exit(ORPHAN_EXIT_CODE)


def _is_pytest_skip(e: BaseException) -> bool:
    return type(e).__name__ == "Skipped" and type(e).__module__.startswith("_pytest")


def _child_main(
    layout: ParallelLayout,
    rank: int,
    backend: str,
    cuda_device: Optional[int],
    store_path: str,
    hb_path: str,
    env: dict[str, str],
    payload: bytes,
    conn: Any,
    ctrl: Any,
    parent_pid: int,
    pg_timeout_s: float,
    check_signatures: Optional[bool],
) -> None:
    os.environ.update(env)
    _set_pdeathsig(parent_pid)
    command: dict[str, str] = {}
    told = threading.Event()

    def lifeline() -> None:
        try:
            command["cmd"] = ctrl.recv()
        except (EOFError, OSError):
            os._exit(ORPHAN_EXIT_CODE)  # the parent is gone: do not outlive it
        told.set()

    threading.Thread(target=lifeline, name="specharness-lifeline", daemon=True).start()
    write_heartbeat(hb_path, {"rank": rank, "state": "starting"})

    import torch
    import torch.distributed as dist

    from harness.ranks.distributed import DistComm

    torch.set_num_threads(1)
    comm = None
    code = 0
    try:
        fn, args = pickle.loads(payload)
        if backend == "nccl":
            torch.cuda.set_device(cuda_device)
        store = dist.FileStore(store_path, layout.world_size)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=layout.world_size, timeout=timedelta(seconds=pg_timeout_s)
        )
        comm = DistComm(layout, rank, check_signatures=check_signatures, heartbeat_path=hb_path)
        write_heartbeat(hb_path, {"rank": rank, "state": "ready"})
        conn.send_bytes(pickle.dumps(("ready",)))
        result = fn(comm, *args)
        outcome: tuple = ("ok", _to_cpu(result))
    except RankSkip as e:
        outcome, code = ("skip", str(e) or "RankSkip"), SKIP_EXIT_CODE
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        if _is_pytest_skip(e):
            outcome, code = ("skip", str(getattr(e, "msg", e))), SKIP_EXIT_CODE
        else:
            outcome, code = ("error", _error_payload(e, traceback.format_exc())), FAIL_EXIT_CODE
    trace = list(comm.trace) if comm is not None else []
    try:
        data = pickle.dumps(("outcome", outcome[0], outcome[1], trace))
    except Exception as e:  # noqa: BLE001 - an unpicklable result is this rank's failure
        tb = f"fn's result on rank {rank} does not pickle: {type(e).__name__}: {e}"
        data = pickle.dumps(("outcome", "error", _error_payload(e, tb), trace))
        code = FAIL_EXIT_CODE
    try:
        conn.send_bytes(data)
    except (OSError, EOFError):
        os._exit(ORPHAN_EXIT_CODE)
    told.wait(pg_timeout_s)
    if command.get("cmd") == "exit" and code == 0:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: it can hang on a process group whose peers are gone


def _error_payload(e: BaseException, tb: str) -> dict[str, Any]:
    return {
        "summary": f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__,
        "message": str(e),
        "traceback": tb,
        "mismatch": isinstance(e, CollectiveMismatch),
    }


def _to_cpu(result: Any) -> Any:
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) and x.device.type != "cpu" else x, result)
