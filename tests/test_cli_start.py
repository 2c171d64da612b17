"""The CLI's cold start: a command's module is imported when that command runs, so `harness --version` and `--help`
import neither torch nor the runners, and a command imports no other command's module. Each case runs in a fresh
interpreter: this process imported everything long before."""
from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import COMMANDS

REPO = Path(__file__).parent.parent
COMMAND_MODULES = sorted({c.module for c in COMMANDS.values()})


def _loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running `code`."""
    probe = f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("argv", [["--version"], ["--help"]], ids=" ".join)
def test_version_and_help_import_no_torch_and_no_command(argv):
    loaded = _loaded_after(f"from harness.cli import main\nassert main({argv!r}) == 0")
    assert not {"torch", "runners", *COMMAND_MODULES} & loaded, sorted({"torch", "runners", *COMMAND_MODULES} & loaded)


def test_explain_imports_no_torch():
    loaded = _loaded_after("from harness.cli import main\nassert main(['explain', 'I3']) == 0")
    assert "torch" not in loaded


@pytest.mark.parametrize("argv,modules", [
    (["mutants", "--only", "sglang-26416"], {"harness.cli.mutants"}),
    (["check", "tp1_neither"], {"harness.cli.check", "harness.cli.cases"}),  # check takes cases' --cases-dir and case names
    (["explain", "P1"], {"harness.cli.explain"}),
], ids=lambda v: v[0] if isinstance(v, list) else "")
def test_parsing_a_command_imports_its_module_alone(argv, modules):
    loaded = _loaded_after(f"from harness.cli import build_parser\nbuild_parser().parse_args({argv!r})")
    assert modules <= loaded
    assert not (set(COMMAND_MODULES) - modules) & loaded, sorted((set(COMMAND_MODULES) - modules) & loaded)


def test_every_command_module_adds_the_commands_listed_for_it_with_their_help_line():
    """COMMANDS is `harness --help`'s listing before any module is imported: it must say what the modules say."""
    for module in COMMAND_MODULES:
        mine = {name: c for name, c in COMMANDS.items() if c.module == module}
        sub = argparse.ArgumentParser().add_subparsers()
        getattr(importlib.import_module(module), next(iter(mine.values())).adder)(sub)
        assert {a.dest: a.help for a in sub._choices_actions} == {name: c.help for name, c in mine.items()}, module


def test_a_command_parser_is_built_once_and_every_one_is_reachable():
    from harness.cli import build_parser

    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(action.choices) == list(COMMANDS)  # the names need no module
    check = action.choices["check"]
    assert action.choices["check"] is check and "--props" in check.format_help()
    assert all(isinstance(p, argparse.ArgumentParser) for p in action.choices.values())
    assert parser.parse_args(["explain", "P1"]).id == "P1"
