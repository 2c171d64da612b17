"""The check runs in a child process, so an engine bug that kills a process cannot take the verdict with it.

interpreter.py stops the one kind of engine code known to corrupt memory here (interpreted
Triton kernels) before it writes; this is the net under everything else. The loaded engine is
forked (copy on write: no second import), the child runs the check and hands its report back
pickled. If the child dies instead (a signal, or an exit with no report), the guarded call it
died in is read back from its call log (guard.calls), and the check runs again in a new child
that makes that call nowhere (a bug that kills one replay usually kills them all; one re-run per
call, not per replay) and records each place it would have been made as a `crashed` failure:
the report keeps every other finding and names the call and where it died. A child that dies
outside any guarded call, or in a call already skipped, is ChildDied: nothing left to skip.
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from harness.engines.guard import calls

T = TypeVar("T")
MAX_CRASHES = 5  # distinct calls a run may skip before it gives up


class ChildDied(RuntimeError):
    """The check process died where no guarded call was under way (or in a call already skipped): no report."""


def run_isolated(fn: Callable[[], T], log: Callable[[str], None]) -> T:
    """fn() in a forked child, re-run past the calls children died in (the module docstring). fn's exceptions re-raise here."""
    crashed: dict[str, tuple[str, str]] = {}
    while True:
        with tempfile.TemporaryDirectory(prefix="engine-check-") as tmp:
            died, got = _run_child(fn, Path(tmp), crashed)
        if died is None:
            return got  # type: ignore[return-value]  # the child's result
        if got is None or got[0] in crashed or len(crashed) >= MAX_CRASHES:
            where = f"in {got[0]} [{got[1]}]" if got else "outside any call into the engine"
            raise ChildDied(f"the check process died ({died}) {where}; calls it died in before: {list(crashed) or 'none'}")
        call, at = got
        crashed[call] = (died, at)
        log(f"the check process died ({died}) in {call} [{at}]; checking again without that call")


def _run_child(fn: Callable[[], T], tmp: Path, crashed: dict[str, tuple[str, str]]) -> tuple[Optional[str], Any]:
    """(None, fn's result) or (how the child died, (the guarded call it died in, where) or None)."""
    result, call_log = tmp / "result.pickle", tmp / "calls"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 0
        try:
            fd = os.open(call_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            calls.sink = lambda line: os.write(fd, (line.replace("\n", " ") + "\n").encode())
            calls.crashed = dict(crashed)
            try:
                outcome = ("ok", fn())
            except BaseException as e:  # handed to the parent, which raises it where a plain call would have
                e.add_note("in the check process:\n" + traceback.format_exc().rstrip())
                outcome = ("raised", e)
            _dump(result, outcome)
        except BaseException:
            code = 70
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if result.exists() and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        kind, value = pickle.loads(result.read_bytes())
        if kind == "raised":
            raise value
        return None, value
    how = (f"signal {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status)
           else f"exit {os.WEXITSTATUS(status)} without a report")
    return how, _open_call(call_log)


def _dump(path: Path, outcome: tuple) -> None:
    try:
        data = pickle.dumps(outcome)
    except Exception as e:  # an exception or value that does not pickle: its text still reaches the parent
        data = pickle.dumps(("raised", RuntimeError(f"the check's outcome could not be handed back ({e}): {outcome[1]!r}"[:4000])))
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


def _open_call(call_log: Path) -> Optional[tuple[str, str]]:
    """The innermost guarded call the child had entered and not left: (call, where)."""
    stack: list[tuple[str, str]] = []
    if call_log.exists():
        for line in call_log.read_text(errors="replace").splitlines():
            if line.startswith("+") and "\t" in line:
                call, at = line[1:].split("\t", 1)
                stack.append((call, at))
            elif line == "-" and stack:
                stack.pop()
    return stack[-1] if stack else None
