"""How a command's end becomes an exit code and, under --json, exactly one JSON document on stdout.

Errors are sorted into the few ExitCode classes (harness/errors.py): a user's mistake (exit 2)
gets its one-line message; anything else is ours (exit 3) and keeps its traceback on stderr.
"""
from __future__ import annotations

import json
import sys
from typing import Sequence

from harness.errors import ExitCode, OutOfMemory, UsageError, is_oom


class Tee:
    """Wraps stdout / stderr: knows whether anything reached stdout, and keeps stderr's last error line."""

    def __init__(self, inner, keep_error: bool = False):
        self.inner, self.keep_error, self.wrote, self.last_error = inner, keep_error, False, ""

    def write(self, text: str) -> int:
        self.wrote = self.wrote or bool(text)
        if self.keep_error:
            lines = [ln for ln in text.splitlines() if ln.startswith("error:")]
            self.last_error = lines[-1][len("error:"):].strip() if lines else self.last_error
        return self.inner.write(text)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _error_class(module: str, name: str) -> tuple[type[BaseException], ...]:
    """The error class, if its module is loaded: one never imported raised nothing. Their modules import torch, which a
    command such as `harness explain` never loads, so importing them here would only slow its error report."""
    loaded = sys.modules.get(module)
    return (getattr(loaded, name),) if loaded is not None else ()


def classify(err: BaseException) -> tuple[ExitCode, str, str]:
    """(exit code, kind, one-line message) for an error that ended a command."""
    rank_failure, launch_skipped = _error_class("harness.ranks.sim_failures", "RankFailure"), _error_class("harness.ranks.outcomes", "LaunchSkipped")
    bad_input = _error_class("harness.cases.case", "CaseError") + _error_class("harness.golden.base", "GoldenError")  # every kind of golden
    root = err.root_exception if isinstance(err, rank_failure) else err
    if isinstance(err, OutOfMemory) or is_oom(root):
        return ExitCode.INTERNAL, "out-of-memory", f"out of memory: {str(err).splitlines()[0] if str(err) else type(root).__name__}"
    if isinstance(err, launch_skipped):
        return ExitCode.BAD_INPUT, "bad-input", f"--ranks: {err.reason}"
    if isinstance(err, KeyError):  # unknown mutant id and the like: a user mistake, not a crash
        return ExitCode.BAD_INPUT, "bad-input", str(err.args[0] if err.args else err)
    if isinstance(err, UsageError):
        return ExitCode.BAD_INPUT, "usage", str(err)
    if isinstance(err, bad_input):
        return ExitCode.BAD_INPUT, "bad-input", str(err).replace("\n", " ")
    head = str(err).splitlines()[0] if str(err) else ""
    return ExitCode.INTERNAL, "internal", f"internal error: {type(err).__name__}: {head}"


def wants_json(argv: Sequence[str]) -> bool:
    return any(a == "--json" or a.startswith("--json=") for a in argv)


KINDS = {ExitCode.PROPERTY_FAILED: "property-failed", ExitCode.BAD_INPUT: "bad-input", ExitCode.INTERNAL: "internal"}


def emit_error(code: ExitCode, kind: str, message: str, as_json: bool, to_stderr: bool = True) -> None:
    if to_stderr:
        print(f"error: {message}", file=sys.stderr, flush=True)
    if as_json:
        print(json.dumps({"ok": False, "exit_code": int(code), "error": {"kind": kind, "message": message}}, indent=2), flush=True)
