"""Load an installed engine, check it, report: what every engine's `engine-check` does the same way.

A release the adapter cannot drive (an attribute moved) and the engine's own code raising
while driven are exit 2, never a verdict either way; a report is exit 0 (every check held)
or 1; a release outside what the adapter claims (it predates the checked path or its API) is exit 3
(n/a, with why).
"""
from __future__ import annotations

import json
import sys
import traceback
from typing import Any, Callable, Optional

from harness.engines.install import EngineSpec
from harness.engines.sglang.errors import EngineAdapterError, MissingEngineAttribute, ReleaseNotCovered
from harness.errors import ExitCode
from harness.outcome import KINDS, emit_error

NOT_APPLICABLE = 3  # exit status: the release is outside what the adapter claims (errors.ReleaseNotCovered)
Progress = Optional[Callable[[str], None]]


def drive_engine(spec: EngineSpec, load_engine: Callable[[], Any], check: Callable[[Any, Progress], Any],
                 format_report: Callable[[Any], str], as_json: bool) -> int:
    engine = None
    try:
        engine = load_engine()
        if spec.version is not None and engine.version != spec.version:
            raise EngineAdapterError(f"asked for {spec.name}=={spec.version}, found {engine.version} at {engine.location}")
        progress = None if as_json else (lambda m: print(f"... {m}", file=sys.stderr, flush=True))
        rep = check(engine, progress)
    except ReleaseNotCovered as e:
        print(f"n/a: {spec}: {e}", file=sys.stderr)
        if as_json:
            print(json.dumps({"engine": spec.name, "version": spec.version, "ok": None, "not_covered": str(e)}, indent=2))
        return NOT_APPLICABLE
    except (EngineAdapterError, MissingEngineAttribute) as e:
        return cannot_check(f"the engine adapter cannot drive this release: {e}", as_json)
    except Exception as e:  # the engine's own code raised while being driven: not a verdict either way
        traceback.print_exc()
        what = engine.describe() if engine is not None else str(spec)
        return cannot_check(f"driving {what} raised {type(e).__name__}: {e}", as_json)
    print(json.dumps(rep.to_json(), indent=2, default=str) if as_json else format_report(rep))
    return 0 if rep.ok else 1


def cannot_check(message: str, as_json: bool) -> int:
    """Exit 2: the message on stderr and, under --json, the error document every harness command writes, so the
    module entry point (`python -m harness.engine_check`) keeps the one-JSON-document contract too."""
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
