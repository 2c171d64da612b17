"""`harness`: list cases, check them, replay one, run the mutant catalog, record/check goldens, add a case, check an
installed engine. One module per command (or family of commands), each with its `add_parser`; this one builds the
parser and turns every outcome into an exit code (and one JSON document under --json)."""
from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
import traceback
from typing import Optional, Sequence

from harness import __version__
from harness.bench import command as bench
from harness.cli import cases, check, explain, mutants, new_case, replay
from harness.cli import golden as golden_cli
from harness.cli.ranks import finish, quiet, run_command
from harness.engines import command as engine_check
from harness.errors import ExitCode, UsageError
from harness.outcome import KINDS, Tee, classify, emit_error, wants_json


class _Parser(argparse.ArgumentParser):
    """Usage errors become a UsageError, so main() reports them like any bad input (exit 2, JSON under --json).
    No abbreviations: `--rank 1` on a command without --rank is an unknown option, never a silent `--ranks 1`."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}{self._did_you_mean(message)}")

    def _did_you_mean(self, message: str) -> str:
        """For an unknown --option: the closest option of the command it was given to."""
        if not message.startswith("unrecognized arguments: "):
            return ""
        parser: argparse.ArgumentParser = self
        for word in getattr(self, "argv", ()):  # down to the (sub)command the words name
            sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
            if sub is not None and word in sub.choices:
                parser = sub.choices[word]
        known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
        for word in message.removeprefix("unrecognized arguments: ").split():
            close = difflib.get_close_matches(word.split("=")[0], known, n=1, cutoff=0.75) if word.startswith("--") else []
            if close:
                return f" (did you mean {close[0]}? `{parser.prog} --help` lists its options)"
        return ""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="harness", description="Correctness harness for tensor-parallel speculative decoding (EAGLE draft-extend CUDA graphs).",
                epilog="exit codes: 0 every property held, 1 a property failed, 2 bad input or usage, 3 internal error (out of memory included)")
    p.add_argument("--version", action="version", version=f"harness (specharness) {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    cases.add_parsers(sub)
    new_case.add_parser(sub)
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
    parser = build_parser()
    parser.argv = list(argv)  # type: ignore[attr-defined]  # for the did-you-mean of an unknown option
    return run_command(parser.parse_args(argv))
