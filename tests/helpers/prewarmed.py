"""`python -c CODE` (or `python -m MODULE ARGS`) in a fresh process whose torch, Triton and harness imports are already done.

An engine check must run in a process of its own (loading an engine swaps module globals
process-wide), and each test used to start `python -c`, paying the interpreter's imports of
torch and the harness before the engine's own. Here a forkserver imports those once per xdist
worker and forks each check from it: the child starts with them in sys.modules and nothing
else (no engine, no test state; the forkserver never runs torch ops, so no thread pool is
forked), runs CODE as __main__ in the repo root, and hands back its exit code and output.

The same server runs the tests that start the `harness` command or an inner pytest as a user would
(tests/test_cli.py, test_hostile_inputs.py, test_plugin.py): a process of its own, its own cwd and
environment, its exit code and output read back, without paying torch's import each time.
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Optional, Sequence

from harness.ranks import forkserver

REPO = Path(__file__).resolve().parents[2]
# torch's own heavy subpackages that the engines' modules import (dynamo, inductor, distributed, ...), and ours. None
# of them is a name the engine adapters stub (harness/engines/*/stubs.py), so every engine module still resolves as
# it would in a fresh process.
PRELOAD = ["torch", "triton", "torch._dynamo", "torch._inductor.compile_fx", "torch.ao.quantization", "torch.distributed.distributed_c10d",
           "torch.onnx", "torch.export", "torch.testing", "sympy", "networkx", "jinja2", "filelock", "packaging.version",
           "harness.engines.check", "harness.engines.sglang.loader", "harness.engines.vllm.command", "harness.engines.vllm.loader",
           "runners.parallel.layout"]

# Started with TRITON_INTERPRET=1, as the engine loaders set it before their first Triton import: the kernels the
# preloaded modules jit are then interpreted ones, as in a fresh engine process. The server is the process's one
# forkserver (harness.ranks.forkserver), which the gloo rank launcher forks its ranks from too.
forkserver.register(PRELOAD, {"TRITON_INTERPRET": "1"})


def _child(code: str, out: str, err: str, cwd: Path, env: Optional[dict[str, str]]) -> None:
    # the preloaded modules' objects (torch's, most of a million) are never garbage: frozen out of the collector's
    # reach, every full collection the child makes (the automatic ones, pytest's at exit) skips them. An engine
    # check's memory guard, which finds live tensors through gc.get_objects(), thaws them first
    # (harness/engines/interpreter.py)
    gc.freeze()
    os.chdir(cwd)
    if env is not None:  # the caller's environment, as subprocess.run(env=...) gives it; Triton was imported interpreted
        os.environ.clear()
        os.environ.update(env, TRITON_INTERPRET="1")
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

    def __init__(self, code: str, cwd: Path = REPO, env: Optional[dict[str, str]] = None) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="prewarmed-")
        self._out, self._err = os.path.join(self._dir.name, "out"), os.path.join(self._dir.name, "err")
        self._proc = forkserver.context().Process(target=_child, args=(code, self._out, self._err, cwd, env))
        self._proc.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def stderr_so_far(self) -> str:
        """What the child has written to stderr yet (Python's stderr is line-buffered: whole lines)."""
        return Path(self._err).read_text() if os.path.exists(self._err) else ""

    def wait(self, timeout: float) -> Optional[int]:
        """The exit code (a signal's as -N, as Popen gives it), or None while it still runs after timeout."""
        self._proc.join(timeout)
        return self._proc.exitcode

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
    """CODE in the forkserver's own environment (the engine checks set what they need themselves)."""
    return Started(code).result(timeout)


def start_module(module: str, *args: str, cwd: Path = REPO, env: Optional[dict[str, str]] = None, fresh: Sequence[str] = ()) -> Started:
    """`python -m MODULE ARGS` started in cwd with env (default: this process's environment, as subprocess.run inherits it):
    sys.argv and sys.path[0] as -m sets them, the module's own `if __name__ == "__main__"` block, its exit code.
    The packages named in `fresh` are dropped from the preloaded modules and imported by the run itself, as a fresh
    process would: pytest rewrites the asserts of a plugin's package (an editable install's `harness`) as it imports it."""
    code = (f"import runpy, sys\nfor m in [m for m in sys.modules if m.partition('.')[0] in {tuple(fresh)!r}]:\n    del sys.modules[m]\n"
            f"sys.argv = ['-m', *{list(args)!r}]\nsys.path.insert(0, {str(cwd)!r})\nrunpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")
    return Started(code, cwd, dict(os.environ) if env is None else env)


def start_script(path: Path, *args: str, cwd: Path = REPO, env: Optional[dict[str, str]] = None) -> Started:
    """`python PATH ARGS` started in cwd with env (default: this process's environment): sys.argv and sys.path[0] as
    running a script sets them."""
    code = (f"import runpy, sys\nsys.argv = [{str(path)!r}, *{list(args)!r}]\nsys.path.insert(0, {str(Path(path).parent)!r})\n"
            f"runpy.run_path({str(path)!r}, run_name='__main__')\n")
    return Started(code, cwd, dict(os.environ) if env is None else env)


def run_module(module: str, *args: str, cwd: Path = REPO, env: Optional[dict[str, str]] = None, fresh: Sequence[str] = (),
               timeout: float = 600) -> subprocess.CompletedProcess:
    """start_module's run, waited for as subprocess.run would."""
    return start_module(module, *args, cwd=cwd, env=env, fresh=fresh).result(timeout)
