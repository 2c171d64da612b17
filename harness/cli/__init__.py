"""`harness`: list cases, check them, replay one, run the mutant catalog, record/check goldens, add a case, check an
installed engine. One module per command (or family of commands), each with its `add_parser`; this one builds the
parser and turns every outcome into an exit code (and one JSON document under --json).

A command's module is imported when that command runs (or its parser is asked for), never at start: the modules
import torch, the runners and the case pipeline, which `harness --version`, `--help` and `explain` do not need.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import os
import sys
import traceback
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Optional, Sequence

from harness import __version__
from harness.cli.ranks import finish, quiet, run_command
from harness.errors import ExitCode, UsageError
from harness.outcome import KINDS, Tee, classify, emit_error, wants_json


@dataclass(frozen=True)
class Command:
    module: str  # imported when the command runs
    adder: str  # the module's function that adds the command's parser (and its siblings') to the subparsers
    help: str  # its line in `harness --help` (the module passes the same; tests/test_cli_start.py holds them equal)


COMMANDS: dict[str, Command] = {
    "list": Command("harness.cli.cases", "add_parsers", "list cases with layout and branch"),
    "case-schema": Command("harness.cli.cases", "add_parsers", "print the JSON Schema of case files (for editors; the loader checks the rest)"),
    "new-case": Command("harness.cli.new_case", "add_parser",
                        "write <dir>/<name>.toml for a parallel config (--record: and every golden its checks read)"),
    "check": Command("harness.cli.check", "add_parser", "run the properties over cases (the main job)"),
    "replay": Command("harness.cli.replay", "add_parser", "rerun one case step by step and show the first divergence"),
    "mutants": Command("harness.cli.mutants", "add_parser", "plant each mutant, run the fast properties, report kills"),
    "bench": Command("harness.bench.command", "add_parser", "draft-extend step time: eager vs graph replay, per attention backend and batch size"),
    "golden": Command("harness.cli.golden", "add_parser",
                      "record or check goldens: arrays (<case>.npz + .json), acceptance, draft trees, logprobs"),
    "engine-check": Command("harness.engines.command", "add_parser",
                            "our invariants on an installed SGLang's or vLLM's own graph runners (CPU, no model, no GPU)"),
    "explain": Command("harness.cli.explain", "add_parser", "what a property (P1-P8) or invariant (I1-I7) asserts, why, and a bug it catches"),
}


class _Parsers(MutableMapping):
    """argparse's map of command name -> parser (the subparsers action's `choices`), whose parsers a command's module
    builds the first time one of them is asked for. argparse asks only for the chosen command's (membership and the
    names, for usage and errors, need no parser), so a run imports that command's module alone."""

    def __init__(self, action: "_Commands") -> None:
        self._action = action
        self._parsers: dict[str, argparse.ArgumentParser] = {}
        self._pending = dict(COMMANDS)  # name -> its Command, until its module has added its parser

    def __getitem__(self, name: str) -> argparse.ArgumentParser:
        if name not in self._parsers and name in self._pending:
            command = self._pending[name]
            for sibling in [n for n, c in self._pending.items() if c.module == command.module]:
                del self._pending[sibling]  # the module adds them all
            getattr(importlib.import_module(command.module), command.adder)(self._action)
        return self._parsers[name]

    def __setitem__(self, name: str, parser: argparse.ArgumentParser) -> None:
        self._parsers[name] = parser

    def __delitem__(self, name: str) -> None:
        if name in self._pending:
            del self._pending[name]
        else:
            del self._parsers[name]

    def __contains__(self, name: object) -> bool:
        return name in self._parsers or name in self._pending

    def __iter__(self) -> Iterator[str]:
        return iter([n for n in COMMANDS if n in self] + [n for n in self._parsers if n not in COMMANDS])

    def __len__(self) -> int:
        return len(set(self._parsers) | set(self._pending))


class _Commands(argparse._SubParsersAction):
    """The subcommands of `harness`, their parsers built on demand (_Parsers); `harness --help` lists COMMANDS."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._name_parser_map = self.choices = _Parsers(self)
        for name, command in COMMANDS.items():
            self._choices_actions.append(self._ChoicesPseudoAction(name, (), command.help))

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        if name in COMMANDS:
            kwargs.pop("help", None)  # its `harness --help` line is COMMANDS' already
        return super().add_parser(name, **kwargs)


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
    p.add_subparsers(dest="command", required=True, action=_Commands)
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
