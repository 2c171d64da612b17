"""The spawning launcher's child side: one rank process joins the FileStore rendezvous, runs
fn, sends its outcome and trace back over a pipe, and never outlives its parent. The mutants
planted in the parent (their ids in PLANTED_ENV) are planted around fn, so a spawned rank runs
the same code as the parent's simulated ranks would.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
import traceback
from datetime import timedelta
from typing import Any, Optional

from harness.mutants.base import PLANTED_ENV
from harness.ranks.distributed import DistComm
from harness.ranks.heartbeat import write_heartbeat
from harness.ranks.outcomes import (
    FAIL_EXIT_CODE,
    ORPHAN_EXIT_CODE,
    SKIP_EXIT_CODE,
    RankSkip,
    error_payload,
    is_pytest_skip,
    to_cpu,
)
from runners.parallel.layout import ParallelLayout


def _set_pdeathsig(parent_pid: int) -> None:
    """Linux: SIGKILL this process when its parent dies (a second line behind the lifeline). A rank forked by the
    forkserver has the server as its parent, which outlives the launch: there the lifeline alone guards."""
    if os.getppid() != parent_pid:
        if _alive(parent_pid):
            return
        os._exit(ORPHAN_EXIT_CODE)
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except Exception:  # noqa: BLE001 - best effort
            pass
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        os._exit(ORPHAN_EXIT_CODE)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def child_main(
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
    os.environ.clear()  # the parent's environment, also where the process was forked from a server started with another
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
        with contextlib.ExitStack() as planted:
            ids = [m for m in os.environ.get(PLANTED_ENV, "").split(",") if m]
            if ids:
                # imported here, not at the top: the catalog imports every runner module, and the fork server that
                # preloads this module must fork its ranks with nothing but torch imported
                from harness.mutants import get as get_mutant

                for mutant_id in ids:
                    planted.enter_context(get_mutant(mutant_id).planted())
            result = fn(comm, *args)
        outcome: tuple = ("ok", to_cpu(result))
    except RankSkip as e:
        outcome, code = ("skip", str(e) or "RankSkip"), SKIP_EXIT_CODE
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        if is_pytest_skip(e):
            outcome, code = ("skip", str(getattr(e, "msg", e))), SKIP_EXIT_CODE
        else:
            outcome, code = ("error", error_payload(e, traceback.format_exc())), FAIL_EXIT_CODE
    trace = list(comm.trace) if comm is not None else []
    try:
        data = pickle.dumps(("outcome", outcome[0], outcome[1], trace))
    except Exception as e:  # noqa: BLE001 - an unpicklable result is this rank's failure
        tb = f"fn's result on rank {rank} does not pickle: {type(e).__name__}: {e}"
        data = pickle.dumps(("outcome", "error", error_payload(e, tb), trace))
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
