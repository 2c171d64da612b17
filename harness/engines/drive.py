"""Load an installed engine, check it, report: what every engine's `engine-check` does the same way.

Exit 2 is "this release cannot be checked", decided before any check runs: the engine is not
installed, does not import, or the adapter cannot drive it (load() and the check's pre-flight,
the first rank's runners built; an adapter error there); a baseline file that cannot be read is
exit 2 too. Once checks run, nothing the engine does costs the verdict: a call that raises is
a finding of its check (guard.py), an interpreted kernel is stopped before it corrupts memory
(interpreter.py), and the check runs in a child process that a crash cannot take the report
with (isolate.py). A report is exit 0 (every check held, or every finding is in the baseline)
or 1; a release outside what the adapter claims (it predates the checked path or its API) is
exit 3 (n/a, with why). Every exit writes its one JSON document under --json.
"""
from __future__ import annotations

import json
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from harness.engines.baseline import Baseline, BaselineError
from harness.engines.install import EngineSpec
from harness.engines.isolate import ChildDied, run_isolated
from harness.engines.sglang.errors import EngineAdapterError, MissingEngineAttribute, ReleaseNotCovered
from harness.errors import ExitCode
from harness.outcome import KINDS, emit_error

NOT_APPLICABLE = 3  # exit status: the release is outside what the adapter claims (errors.ReleaseNotCovered)
Progress = Optional[Callable[[str], None]]


@dataclass(frozen=True)
class BaselineFiles:
    """--baseline FILE (classify the findings against it) and --write-baseline FILE (write this run's findings)."""

    read: Optional[Path] = None
    write: Optional[Path] = None

    @classmethod
    def from_args(cls, args: Any) -> "BaselineFiles":
        return cls(*(Path(p) if p else None for p in (getattr(args, "baseline", None), getattr(args, "write_baseline", None))))


def drive_engine(spec: EngineSpec, load_engine: Callable[[], Any], check: Callable[[Any, Progress], Any],
                 format_report: Callable[[Any], str], as_json: bool, baseline: BaselineFiles = BaselineFiles()) -> int:
    try:
        known = _load_baseline(baseline.read, spec.name)
    except BaselineError as e:
        return cannot_check(f"--baseline {e}", as_json)
    engine = None
    progress = None if as_json else (lambda m: print(f"... {m}", file=sys.stderr, flush=True))
    try:
        engine = load_engine()
        if spec.version is not None and engine.version != spec.version:
            raise EngineAdapterError(f"asked for {spec.name}=={spec.version}, found {engine.version} at {engine.location}")
        rep = run_isolated(lambda: check(engine, progress), lambda m: print(f"!!! {m}", file=sys.stderr, flush=True))
    except ReleaseNotCovered as e:
        print(f"n/a: {spec}: {e}", file=sys.stderr)
        if as_json:
            print(json.dumps({"engine": spec.name, "version": spec.version, "ok": None, "not_covered": str(e)}, indent=2))
        return NOT_APPLICABLE
    except (EngineAdapterError, MissingEngineAttribute) as e:
        return cannot_check(f"the engine adapter cannot drive this release: {e}", as_json)
    except ChildDied as e:
        what = engine.describe() if engine is not None else str(spec)
        return cannot_check(f"checking {what}: {e}", as_json)
    except Exception as e:  # the adapter's own code failed outside every guarded engine call: no verdict either way
        traceback.print_exc()
        what = engine.describe() if engine is not None else str(spec)
        return cannot_check(f"driving {what} raised {type(e).__name__}: {e}", as_json)
    if baseline.write is not None:
        try:
            rep.as_baseline(spec.name, f"{spec.name} {engine.version}").write(baseline.write)
        except OSError as e:
            return cannot_check(f"--write-baseline {baseline.write}: cannot write it: {e.strerror or e}", as_json)
        print(f"baseline written: {baseline.write} ({len({rep.finding(ln, f) for ln in rep.lines for f in ln.verdict.failures})} "
              "finding identities)", file=sys.stderr)
        known = _load_baseline(baseline.write, spec.name)
    if known is not None:
        rep.classify(known, str(baseline.write or baseline.read))
    print(json.dumps(rep.to_json(), indent=2, default=str) if as_json else format_report(rep))
    return rep.exit_code()


def _load_baseline(path: Optional[Path], engine: str) -> Optional[Baseline]:
    if path is None:
        return None
    base = Baseline.load(path)
    if base.engine != engine:
        raise BaselineError(f"{path}: engine: written for {base.engine}, this run checks {engine}")
    return base


def cannot_check(message: str, as_json: bool) -> int:
    """Exit 2: the message on stderr and, under --json, the error document every harness command writes, so the
    module entry point (`python -m harness.engines`) keeps the one-JSON-document contract too."""
    emit_error(ExitCode.BAD_INPUT, KINDS[ExitCode.BAD_INPUT], message, as_json)
    return ExitCode.BAD_INPUT


class Strict:
    """Attributes given at construction; reading any other raises MissingEngineAttribute naming it
    and where the adapter's stand-ins live (`engine` and `where` per adapter)."""

    engine = "the engine"
    where = "the adapter's stand-ins"

    def __init__(self, _name: str, **attrs: Any) -> None:
        object.__setattr__(self, "_name", _name)
        for k, v in attrs.items():
            object.__setattr__(self, k, v)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise MissingEngineAttribute(
            f"{self.engine} read {self._name}.{name}, which the adapter's stand-in does not provide "
            f"(a release moved something: add it in {self.where})"
        )
