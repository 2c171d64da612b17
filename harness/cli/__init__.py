"""`harness`: list cases, check them, replay one, run the mutant catalog, record/check goldens, add a case, check an
installed engine. One module per command (or family of commands), each with its `add_parser`; this one builds the
parser and turns every outcome into an exit code (and one JSON document under --json)."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from typing import Optional, Sequence

from harness import __version__, bench, engine_check
from harness.cli import cases, check, explain, mutants, replay
from harness.cli import golden as golden_cli
from harness.cli.ranks import finish, quiet, run_command
from harness.errors import ExitCode, UsageError
from harness.outcome import KINDS, Tee, classify, emit_error, wants_json


class _Parser(argparse.ArgumentParser):
    """Usage errors become a UsageError, so main() reports them like any bad input (exit 2, JSON under --json)."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="harness", description="Correctness harness for tensor-parallel speculative decoding (EAGLE draft-extend CUDA graphs).",
                epilog="exit codes: 0 every property held, 1 a property failed, 2 bad input or usage, 3 internal error (out of memory included)")
    p.add_argument("--version", action="version", version=f"harness (specharness) {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    cases.add_parsers(sub)
    check.add_parser(sub)
    replay.add_parser(sub)
    mutants.add_parser(sub)
    bench.add_parser(sub)
    golden_cli.add_parser(sub)
    engine_check.add_parser(sub)
    explain.add_parser(sub)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command; the exit code is an ExitCode, and under --json stdout holds exactly one JSON document."""
    return finish(_main(argv))


def _main(argv: Optional[Sequence[str]]) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = wants_json(argv) and not quiet()
    out, err = Tee(sys.stdout), Tee(sys.stderr, keep_error=True)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = _run(argv)
    except SystemExit as e:  # --help, --version (code 0); a command that exits with a message is a usage error
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        msg = str(e.code).removeprefix("error: ")
        if not quiet():
            emit_error(ExitCode.BAD_INPUT, "usage", msg, as_json)
        return ExitCode.BAD_INPUT
    except BrokenPipeError:  # `harness list | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.OK
    except Exception as e:  # noqa: BLE001 - every error becomes an exit code and a message, never a bare traceback
        code, kind, msg = classify(e)
        if code is ExitCode.INTERNAL and kind == "internal":
            traceback.print_exc(file=sys.stderr)  # ours to fix: the report needs the traceback
        if kind == "internal" or not quiet():  # launched ranks but 0: rank 0 reports what they all saw
            emit_error(code, kind, msg, as_json)
        return code
    if as_json and rc and not out.wrote:  # a command that reported its error on stderr only
        code = ExitCode(rc) if rc in (1, 2, 3) else ExitCode.INTERNAL
        emit_error(code, KINDS[code], err.last_error or f"exit {rc}; see stderr", True, to_stderr=False)
    return rc


def _run(argv: Sequence[str]) -> int:
    return run_command(build_parser().parse_args(argv))
