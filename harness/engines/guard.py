"""A call into an engine that raises is a finding of the check that made it, never the end of the run.

Once an adapter has shown it can drive a release (drive.py's pre-flight), every call into the
engine's code is made through `guarded`: an exception there -- the engine's own code raising,
an interpreted kernel stopped before an out-of-bounds access (interpreter.py), or the engine
reading something the adapter's stand-ins lack -- is recorded as a failure of the check that
made the call (check `raised`, field the call, got the exception, detail the engine's own
frame it came from), and the other checks go on. An interpreted kernel it launched that reached
out of bounds (masked off by interpreter.py) is a failure of the call too (`out of bounds`). `calls` keeps the calls under way, so a
process that dies anyway can say in which call (isolate.py), and a re-run can skip that call,
recording it as `crashed` instead.
"""
from __future__ import annotations

import traceback
from pathlib import Path
from typing import Callable, Optional, TypeVar

from harness.engines import interpreter
from harness.engines.sglang.errors import ReleaseNotCovered
from harness.verdict import Verdict

RAISED = "raised"
CRASHED = "crashed"
OUT_OF_BOUNDS = "out of bounds"
T = TypeVar("T")


class CallLog:
    """The guarded calls under way (a stack: innermost last). `sink` persists each entry and exit as it happens (isolate.py
    reads them back from a process that died); `crashed` holds the calls a process died in, which a re-run records as
    failures instead of making them: call (and runner) -> (how the process died, where it died)."""

    def __init__(self) -> None:
        self.open: list[tuple[str, str]] = []
        self.sink: Optional[Callable[[str], None]] = None
        self.crashed: dict[str, tuple[str, str]] = {}

    def enter(self, call: str, where: str) -> None:
        self.open.append((call, where))
        if self.sink is not None:
            self.sink(f"+{call}\t{where}")

    def leave(self) -> None:
        self.open.pop()
        if self.sink is not None:
            self.sink("-")


calls = CallLog()


def guarded(v: Verdict, call: str, where: dict, fn: Callable[[], T], engine_root: Optional[str] = None,
            reraise: tuple[type[BaseException], ...] = ()) -> Optional[T]:
    """fn(), or None with a `raised` failure on `v` naming the call, the exception and the engine frame it left.
    `reraise`: exception types that are not findings here (the pre-flight's adapter errors: drive.py)."""
    at = ", ".join(f"{k}={x}" for k, x in where.items())
    ident = f"{call} (runner {where['runner']})" if "runner" in where else call  # what a crash skips: this call of this runner
    if ident in calls.crashed:  # a process died in this call (isolate.py): it is not made again, anywhere
        how, died_at = calls.crashed[ident]
        v.checked += 1
        v.fail(CRASHED, call, where, "the call returns", f"the check process died ({how})" if died_at == at else "not made",
               "an engine bug that kills the process (memory corruption, a signal)" + ("" if died_at == at else f": it died in this call "
               f"at [{died_at}], so the re-run makes this call nowhere") + "; what ran after it ran without its effects")
        return None
    calls.enter(ident, at)
    mark = len(interpreter.VIOLATIONS)
    try:
        return fn()
    except (MemoryError, ReleaseNotCovered, *reraise):
        raise  # the machine ran short, or the release is outside the adapter's reach: no finding about the engine
    except Exception as e:
        v.checked += 1
        v.fail(RAISED, call, where, "no exception", f"{type(e).__name__}: {_first_line(e)}", raised_from(e, engine_root))
        return None
    finally:
        calls.leave()
        for x in interpreter.VIOLATIONS[mark:]:  # the interpreted kernels this call launched that reached out of bounds
            v.checked += 1
            v.fail(OUT_OF_BOUNDS, call, {**where, "kernel": x.kernel, "argument": x.argument}, "every access inside its tensor arguments",
                   x.message, f"an out-of-bounds {x.op} in {x.kernel}, masked off: the call ran on without it")
        del interpreter.VIOLATIONS[mark:]


def raised_from(e: BaseException, engine_root: Optional[str]) -> str:
    """The innermost frame of the engine's own code (under engine_root) the exception came through, else the innermost."""
    frames = traceback.extract_tb(e.__traceback__)
    cause = e.__cause__
    while cause is not None:  # an interpreter error wraps the kernel's own exception
        frames += traceback.extract_tb(cause.__traceback__)
        cause = cause.__cause__
    if not frames:
        return ""
    root = str(Path(engine_root).resolve()) if engine_root else None
    own = [f for f in frames if root is not None and str(Path(f.filename).resolve()).startswith(root)]
    f = (own or frames)[-1]
    where = str(Path(f.filename).resolve().relative_to(root)) if own else Path(f.filename).name
    return f"raised at {where}:{f.lineno} in {f.name}" + (f": {f.line.strip()}" if f.line else "")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:400] if text else ""
