"""Real ranks started by an outside launcher (torchrun, srun): this process is one rank.

Every process runs the same command (`harness check --ranks gloo <case>`); rank 0 drives
it and the others serve. Rank 0 runs the command as it would alone, and each time it needs
the ranks (harness.ranks.launcher.launch, as checks, replay and P7 call it) it publishes a
job in the launcher's env:// store: the layout, fn and its args, pickled exactly as the
spawning launcher sends them to its children. Every rank then joins a process group of its
own for that job (over a store prefix of the job, so a failed job never poisons the next),
runs its part, and posts its outcome (result, trace, or failure) back through the store.
Rank 0 gathers them, judges the properties and prints the report; the others print
nothing. When the command ends, rank 0 publishes its exit code and every rank exits with it.

Everything that must survive a failure travels through the store, never through a
collective: a rank that raises posts its failure first and then destroys its process
groups, which closes its sockets, so a peer blocked in a collective with it fails at once
("connection closed by peer") instead of waiting out the timeout. A rank that returns from
fn while a peer still waits for it (a skipped collective with no signature exchange) does
the same after a short grace. A hang nobody escapes ends at the process group's timeout.
"""
from __future__ import annotations

import gc
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from harness.errors import UsageError
from harness.ranks.distributed import DistComm
from harness.ranks.heartbeat import read_heartbeat, write_heartbeat
from harness.ranks.joined_report import Outcome, launch_error
from harness.ranks.launch_env import LauncherEnv, launcher_env
from harness.ranks.outcomes import LaunchResult, RankSkip, error_payload, is_pytest_skip, to_cpu, where_of
from runners.parallel.layout import ParallelLayout

ENV_ALWAYS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
POLL_S = 0.05  # store polling: followers waiting for a job, rank 0 for outcomes
FINISHED_GRACE_S = 2.0  # a rank done with fn keeps its sockets open this long for peers still finishing
RENDEZVOUS_TIMEOUT_S = 300.0  # every process of the launch must reach the store within this
BYE_TIMEOUT_S = 30.0  # rank 0 waits this long for every rank to have read the exit code

_current: Optional["JoinedWorld"] = None


def current_world() -> Optional["JoinedWorld"]:
    """The world this process joined (None: not started by an outside launcher, or not joined)."""
    return _current


def join_if_launched(ranks: str) -> Optional["JoinedWorld"]:
    """Join the launcher's world when real ranks were asked for and a launcher started us."""
    global _current
    if ranks not in ("gloo", "nccl") or _current is not None:
        return _current
    env = launcher_env()
    if env is None:
        return None
    _current = JoinedWorld.join(env)
    return _current


def check_world(named_layouts: list[tuple[str, ParallelLayout]]) -> None:
    """Under a launcher every case must need exactly the launched world size (a usage error otherwise)."""
    if _current is not None:
        for name, layout in named_layouts:
            _current.require(layout, name)


class JoinedWorld:
    def __init__(self, env: LauncherEnv, store: Any) -> None:
        self.env = env
        self.rank, self.world_size = env.rank, env.world_size
        self.store = store
        self.prefix = f"specharness/{env.run_id}/"
        self.jobs = 0

    @classmethod
    def join(cls, env: LauncherEnv) -> "JoinedWorld":
        os.environ.update(env.env_vars())  # SLURM: the env:// names torch reads
        for k, v in ENV_ALWAYS.items():
            os.environ.setdefault(k, v)
        store, rank, ws = next(dist.rendezvous("env://", timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S)))
        assert (rank, ws) == (env.rank, env.world_size)
        return cls(env, store)

    def require(self, layout: ParallelLayout, what: str = "") -> None:
        if layout.world_size != self.world_size:
            raise UsageError(f"{what + ': ' if what else ''}layout {layout.describe()} needs world size {layout.world_size}, "
                             f"but {self.env.describe()}; start {layout.world_size} (torchrun --nproc-per-node, srun -n)")

    # ---- rank 0 ----
    def launch(self, layout: ParallelLayout, fn: Callable[..., Any], *args: Any, backend: str = "gloo",
               timeout_s: float = 60.0, failure_grace_s: float = 5.0, check_signatures: Optional[bool] = None) -> LaunchResult:
        """What harness.ranks.launcher.launch does, on the launched processes: rank 0 only."""
        if self.rank != 0:
            raise RuntimeError("JoinedWorld.launch runs on rank 0; the other ranks serve()")
        self.require(layout)
        backend = backend.lower()
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        try:
            job = pickle.dumps((layout, backend, fn, args, timeout_s, check_signatures))
        except Exception as e:
            raise TypeError(f"launch: fn and args must pickle (fn must be a module-level function): {e}") from e
        n = self._publish(("job", job))
        t0 = time.monotonic()
        mine = self._run_part(n, layout, backend, fn, args, timeout_s, check_signatures)
        outcomes = self._gather(n, mine, failure_grace_s if mine.status != "ok" else timeout_s + 10.0)
        elapsed = time.monotonic() - t0
        if all(o is not None and o.status == "ok" for o in outcomes):
            return LaunchResult([o.payload for o in outcomes], [o.trace for o in outcomes], backend, elapsed)  # type: ignore[union-attr]
        raise launch_error(outcomes, f"{self.world_size} ranks, backend {backend}, layout {layout.describe()}, {self.env.source}", elapsed)

    def _publish(self, message: tuple) -> int:
        n = self.jobs
        self.jobs += 1
        self.store.set(f"{self.prefix}next/{n}", pickle.dumps(message))
        return n

    def _gather(self, n: int, mine: Outcome, wait_s: float) -> list[Optional[Outcome]]:
        outcomes: list[Optional[Outcome]] = [mine] + [None] * (self.world_size - 1)
        keys = {r: f"{self.prefix}out/{n}/{r}" for r in range(1, self.world_size)}
        deadline = time.monotonic() + wait_s
        while True:
            for r, key in keys.items():
                if outcomes[r] is None and self.store.check([key]):
                    outcomes[r] = pickle.loads(self.store.get(key))
            if all(o is not None for o in outcomes):
                return outcomes
            if time.monotonic() >= deadline:
                return outcomes
            if any(o is not None and o.status != "ok" for o in outcomes):  # a failure: the rest get the grace
                deadline = min(deadline, time.monotonic() + FINISHED_GRACE_S + 3.0)
            time.sleep(POLL_S)

    # ---- every rank ----
    def serve(self) -> int:
        """Ranks other than 0: run every job rank 0 publishes; return the exit code it ends with."""
        n = 0
        while True:
            key = f"{self.prefix}next/{n}"
            while not self.store.check([key]):
                time.sleep(POLL_S)
            kind, body = pickle.loads(self.store.get(key))
            if kind == "exit":
                return int(body)
            layout, backend, fn, args, timeout_s, check_signatures = pickle.loads(body)
            self._run_part(n, layout, backend, fn, args, timeout_s, check_signatures)
            n += 1

    def _run_part(self, n: int, layout: ParallelLayout, backend: str, fn: Callable[..., Any], args: tuple,
                  timeout_s: float, check_signatures: Optional[bool]) -> Outcome:
        """This rank's part of job n: join the job's process group, run fn, post the outcome, leave the group."""
        fd, hb_path = tempfile.mkstemp(prefix=f"specharness-rank{self.rank}-", suffix=".json")
        os.close(fd)
        write_heartbeat(hb_path, {"rank": self.rank, "state": "starting"})
        comm = None
        try:
            try:
                if backend == "nccl":
                    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
                    if self.env.local_rank >= gpus:
                        raise RankSkip(f"backend nccl needs a GPU per rank: LOCAL_RANK={self.env.local_rank}, and this node has {gpus}")
                    torch.cuda.set_device(self.env.local_rank)
                store = dist.PrefixStore(f"{self.prefix}pg/{n}/", self.store)
                dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size,
                                        timeout=timedelta(seconds=timeout_s))
                comm = DistComm(layout, self.rank, check_signatures=check_signatures, heartbeat_path=hb_path)
                write_heartbeat(hb_path, {"rank": self.rank, "state": "ready"})
                out = Outcome(self.rank, "ok", to_cpu(fn(comm, *args)))
            except RankSkip as e:
                out = Outcome(self.rank, "skip", str(e) or "RankSkip")
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - every failure (pytest.skip too) goes to rank 0 through the store
                if is_pytest_skip(e):
                    out = Outcome(self.rank, "skip", str(getattr(e, "msg", e)))
                else:
                    out = Outcome(self.rank, "error", error_payload(e, traceback.format_exc()))
            out.trace = list(comm.trace) if comm is not None else []
            out.where = where_of(read_heartbeat(hb_path))
            self._post(n, out)
            if out.status == "ok" and self.world_size > 1:
                self._wait_for_peers(n, FINISHED_GRACE_S)
            comm = None  # with fn's frames (gone with the exception), the last references to the groups
            _leave()
            return out
        finally:
            os.unlink(hb_path)

    def _post(self, n: int, out: Outcome) -> None:
        """Rank 0 keeps its own outcome; the others send theirs. Every rank then says it is done."""
        if self.rank == 0:
            self.store.set(f"{self.prefix}done/{n}/0", b"1")
            return
        try:
            data = pickle.dumps(out)
        except Exception as e:  # noqa: BLE001 - an unpicklable result is this rank's failure
            data = pickle.dumps(Outcome(self.rank, "error", error_payload(e, f"fn's result on rank {self.rank} does not pickle: {e}"),
                                        trace=out.trace, where=out.where))
        self.store.set(f"{self.prefix}out/{n}/{self.rank}", data)
        self.store.set(f"{self.prefix}done/{n}/{self.rank}", b"1")

    def _wait_for_peers(self, n: int, grace_s: float) -> None:
        """A rank done with fn keeps its sockets open until every peer is done too, or grace_s passed."""
        keys = [f"{self.prefix}done/{n}/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not self.store.check(keys):
            time.sleep(POLL_S)

    def finish(self, rc: int) -> None:
        """Every rank exits with rank 0's code, after every rank has read it; never returns."""
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGTERM, lambda *_: os._exit(rc))  # torchrun stops the rest once one exits non-zero
        try:
            if self.rank == 0:
                self._publish(("exit", rc))
            self.store.set(f"{self.prefix}bye/{self.rank}", b"1")
            if self.rank == 0:  # under srun rank 0 hosts the store: it leaves last
                keys = [f"{self.prefix}bye/{r}" for r in range(self.world_size)]
                deadline = time.monotonic() + BYE_TIMEOUT_S
                while time.monotonic() < deadline and not self.store.check(keys):
                    time.sleep(POLL_S)
        except Exception:  # noqa: BLE001 - the store went away with rank 0: nothing left to tell
            pass
        os._exit(rc)  # no interpreter teardown: it can hang on a process group whose peers are gone


def _leave() -> None:
    """Destroy this rank's process groups, closing their sockets (peers blocked on us fail at once)."""
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a broken group is still left behind
        pass
    gc.collect()
