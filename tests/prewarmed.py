"""`python -c CODE` in a fresh process whose torch, Triton and harness imports are already done.

An engine check must run in a process of its own (loading an engine swaps module globals
process-wide), and each test used to start `python -c`, paying the interpreter's imports of
torch and the harness before the engine's own. Here a forkserver imports those once per xdist
worker and forks each check from it: the child starts with them in sys.modules and nothing
else (no engine, no test state; the forkserver never runs torch ops, so no thread pool is
forked), runs CODE as __main__ in the repo root, and hands back its exit code and output.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# torch's own heavy subpackages that the engines' modules import (dynamo, inductor, distributed, ...), and ours. None
# of them is a name the engine adapters stub (harness/engines/*/stubs.py), so every engine module still resolves as
# it would in a fresh process.
PRELOAD = ["torch", "triton", "torch._dynamo", "torch._inductor.compile_fx", "torch.ao.quantization", "torch.distributed.distributed_c10d",
           "torch.onnx", "torch.export", "torch.testing", "sympy", "networkx", "jinja2", "filelock", "packaging.version",
           "harness.engines.check", "harness.engines.sglang.loader", "harness.engines.vllm.command", "harness.engines.vllm.loader",
           "runners.parallel.layout"]

_ctx = multiprocessing.get_context("forkserver")
_ctx.set_forkserver_preload(PRELOAD)


def _ensure_forkserver() -> None:
    """Started with TRITON_INTERPRET=1, as the engine loaders set it before their first Triton import: the kernels
    the preloaded modules jit are then interpreted ones, as in a fresh engine process. This process's env is left as it was."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def _child(code: str, out: str, err: str) -> None:
    os.chdir(REPO)
    sys.argv = ["-c"]
    with open(out, "w") as o, open(err, "w") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
        try:
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
        except SystemExit as x:
            sys.stdout.flush()
            if x.code is not None and not isinstance(x.code, int):
                print(x.code, file=sys.stderr)
            sys.stderr.flush()
            os._exit(x.code if isinstance(x.code, int) else 0 if x.code is None else 1)
        except BaseException:
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class Started:
    """One child running; result() waits for it as subprocess.run would."""

    def __init__(self, code: str) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="prewarmed-")
        self._out, self._err = os.path.join(self._dir.name, "out"), os.path.join(self._dir.name, "err")
        _ensure_forkserver()
        self._proc = _ctx.Process(target=_child, args=(code, self._out, self._err))
        self._proc.start()

    def result(self, timeout: float = 600) -> subprocess.CompletedProcess:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join()
            raise subprocess.TimeoutExpired("python -c (prewarmed)", timeout)
        out, err = (Path(f).read_text() if os.path.exists(f) else "" for f in (self._out, self._err))  # none: it died starting
        self._dir.cleanup()
        return subprocess.CompletedProcess(["python", "-c"], self._proc.exitcode, out, err)


def run_python(code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return Started(code).result(timeout)
