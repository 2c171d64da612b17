"""What the README and the docs name is real: every path exists, every `harness SUBCOMMAND --flag` and
`--specharness-*` option is accepted, concrete command lines parse, the README's runnable blocks run, the API
page covers `harness.__all__`, and the mutant page generator renders a run as it should.

The site itself is built by `mkdocs build --strict` in CI (.ci/run), which fails on a broken link, anchor or
missing page; these tests cover what mkdocs cannot see: names of files, commands and options in the text.
"""
import argparse
import ast
import importlib
import inspect
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import harness
from harness.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
GENERATED = {"docs/mutants.md"}  # written by docs/gen_mutants.py (git-ignored), never hand-kept
DOCS = sorted(p for p in [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "harness" / "props" / "reference.md", *(REPO / "docs").glob("*.md")]
              if p.relative_to(REPO).as_posix() not in GENERATED)
# Files the walk-throughs create as their example (a new case and its goldens): named, but absent by design.
EXAMPLE_OUTPUTS = {
    "cases/tp8_dp8_mlp_tp_gather.toml", "golden/tp8_dp8_mlp_tp_gather.npz", "golden/tp8_dp8_mlp_tp_gather.json",
    "golden/acceptance/tp8_dp8_mlp_tp_gather.json", "cases/tp1_a2a_attn_tp_gather.toml", "golden/tp1_a2a_attn_tp_gather.npz",
}
ROOTS = (".ci", "benchmarks", "cases", "docs", "golden", "harness", "requirements", "runners", "tests")
TOP_FILES = ("conftest.py", "pyproject.toml", "setup.py", "tox.ini", "mkdocs.yml", "MANIFEST.in", "CHANGELOG.md")
PATH = re.compile(r"(?<![\w/.-])((?:%s)/[\w./-]*|(?:%s)(?!\w|\.\w))" % ("|".join(re.escape(r) for r in ROOTS),
                                                                     "|".join(re.escape(f) for f in TOP_FILES)))
# a top-level file name ends where no word character or ".ext" follows (so "tox.ini." at a sentence end counts)


def _text(p: Path) -> str:
    return p.read_text(encoding="utf-8")


def _named_paths(text: str) -> set[str]:
    out = set()
    for m in PATH.finditer(text):
        path = m.group(1).rstrip(".,:;")
        after = text[m.end(1):m.end(1) + 1]
        if after in "<{*" and after:  # a pattern (golden/<case>.npz, results/h200_*.json): not one file
            continue
        out.add(path)
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_path_named_in_the_docs_exists(doc):
    missing = sorted(p for p in _named_paths(_text(doc)) if p not in EXAMPLE_OUTPUTS | GENERATED and not (REPO / p).exists())
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def test_the_path_pattern_finds_what_it_should():
    """Hand-worked: the pattern itself, on text of the shapes the docs use."""
    text = ("see `harness/props/reference.md`, runners/attention/ and (tests/test_docs.py). "
            "Not: golden/<case>.npz, benchmarks/results/h200_*.json, sglang/srt/harness/x.py, out/dump, tox.ini.")
    assert _named_paths(text) == {"harness/props/reference.md", "runners/attention/", "tests/test_docs.py", "tox.ini"}


def test_example_outputs_are_absent_and_generated_pages_ignored():
    for p in EXAMPLE_OUTPUTS:
        assert not (REPO / p).exists(), f"{p} exists now: drop it from EXAMPLE_OUTPUTS"
    ignored = subprocess.run(["git", "check-ignore", *GENERATED], cwd=REPO, capture_output=True, text=True)
    if ignored.returncode == 128:
        pytest.skip("not a git checkout")
    assert sorted(ignored.stdout.split()) == sorted(GENERATED)


# ---------------------------------------------------------------------------------------
# commands and flags
# ---------------------------------------------------------------------------------------


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def _options(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


def _mentions(text: str) -> list[str]:
    """Every `harness ...` command named: in code spans, and on the lines of fenced blocks."""
    found = [m.group(1) for m in re.finditer(r"`(harness [^`]+)`", text)]
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in block.splitlines():
            m = re.match(r"^(?:\$ )?(harness [^#]+)", line)
            if m:
                found.append(m.group(1).strip())
    return found


def _command_parsers(mention: str) -> tuple[list[argparse.ArgumentParser], list[str], list[str]]:
    """(the parsers the mention's subcommand path names, that path, the --flags); `record|check` names both."""
    words = mention.replace("\\|", "|").split()[1:]
    parsers, path = [build_parser()], []
    for w in words:
        alts = w.split("|")
        subs = [_subparsers(p) for p in parsers]
        if not all(a in s for a in alts for s in subs):
            break
        path.append(w)
        parsers = [s[a] for s in subs for a in alts]
    return parsers, path, re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", " ".join(words))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_harness_flag_named_in_the_docs_is_accepted(doc):
    bad = []
    for mention in _mentions(_text(doc)):
        parsers, path, flags = _command_parsers(mention)
        if not path and flags and flags != ["--version"]:
            bad.append(f"{mention!r}: no subcommand")
            continue
        for f in flags:
            if any(f not in _options(p) | {"--version", "--help"} for p in parsers):
                bad.append(f"{mention!r}: {f} is not an option of harness {' '.join(path)}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_concrete_command_lines_in_code_blocks_parse(doc):
    """A line of a fenced block that is a whole command (no placeholder) parses as the CLI would parse it."""
    bad = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", _text(doc), re.S):
        for line in block.splitlines():
            m = re.match(r"^(?:\$ )?harness (.*)$", line)
            if not m or re.search(r"[<\[|]|\.\.\.|\bX\b", m.group(1)):
                continue
            lexer = shlex.shlex(m.group(1), posix=True, punctuation_chars=True)
            lexer.whitespace_split, lexer.commenters = True, "#"
            argv = []
            for tok in lexer:  # the command ends at a redirection or the next command (>, &&, ;)
                if tok and set(tok) <= set("<>&;|()"):
                    break
                argv.append(tok)
            try:
                build_parser().parse_args(argv)
            except SystemExit as e:  # --help / --version
                if e.code:
                    bad.append(f"{line!r}: exit {e.code}")
            except Exception as e:  # noqa: BLE001 - the parser's usage error, reported per line
                bad.append(f"{line!r}: {e}")
    assert not bad, "\n".join(bad)


def _plugin_options() -> set[str]:
    from harness.plugin import options

    names: set[str] = set()

    class Group:
        def addoption(self, *opts, **kw):
            names.update(opts)

    class Parser:
        def getgroup(self, *a, **kw):
            return Group()

        def addini(self, *a, **kw):
            pass

    options.pytest_addoption(Parser())
    return names


def test_every_plugin_option_named_in_the_docs_exists():
    known = _plugin_options()
    assert "--specharness-props" in known  # the stub above really collected the plugin's options
    named = {m for doc in DOCS for m in re.findall(r"--specharness-[a-z-]*[a-z]", _text(doc))}
    assert named and named <= known, sorted(named - known)


# ---------------------------------------------------------------------------------------
# the README
# ---------------------------------------------------------------------------------------


def test_readme_is_short_and_keeps_the_quickstart():
    text = _text(REPO / "README.md")
    assert len(text.splitlines()) < 300
    assert "pip install -r requirements/cpu.txt -e . && harness check" in text and "pytest -n auto" in text


def test_readme_runnable_blocks_run():
    """Blocks marked `<!-- runnable -->` run as written, from the repo root, with this interpreter's scripts first on
    PATH (the `harness` of this checkout)."""
    blocks = re.findall(r"<!-- runnable -->\n```bash\n(.*?)```", _text(REPO / "README.md"), re.S)
    assert blocks, "README.md has no block marked <!-- runnable -->"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for block in blocks:
        p = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0, (block, p.stdout[-2000:], p.stderr[-2000:])
        assert p.stdout.strip()


def test_no_history_or_unshipped_design_file_in_what_users_read():
    """The docs speak of versions and dates, not of how the project was built, and cite no design file the package
    does not ship."""
    for doc in DOCS:
        text = _text(doc)
        prose = re.sub(r"`[^`\n]*`", "", text)  # identifiers in code spans (SpecSession) are names, not history
        hits = re.findall(r"\w*session\w*", prose, re.I)
        assert not hits, f"{doc.name}: {hits[:5]}"
        assert "DESIGN" not in text, doc.name


# ---------------------------------------------------------------------------------------
# the API page and the mutant page
# ---------------------------------------------------------------------------------------


def test_api_page_renders_every_public_name_from_where_it_is_defined():
    text = _text(REPO / "docs" / "api.md")
    for name in harness.__all__:
        if name == "__version__":
            continue
        module, attr = harness._EXPORTS[name]
        assert f"### `harness.{name}`\n\n::: {module}.{attr}\n" in text, name


def _has_docstring(module: str, attr: str) -> bool:
    """A function's or class's own docstring; for a module constant, the string literal right after its assignment
    (the attribute docstring mkdocstrings renders), read from the source."""
    obj = getattr(importlib.import_module(module), attr)
    if inspect.isclass(obj) or inspect.isfunction(obj):
        own = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
        generated = inspect.isclass(obj) and own is not None and own.startswith(f"{obj.__name__}(")  # a dataclass's signature
        return bool(own and own.strip()) and not generated
    body = ast.parse(Path(importlib.import_module(module).__file__).read_text()).body
    for stmt, nxt in itertools.pairwise(body):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
            return isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)
    return False


@pytest.mark.parametrize("name", [n for n in harness.__all__ if n != "__version__"])
def test_every_public_name_has_a_docstring(name):
    assert _has_docstring(*harness._EXPORTS[name]), f"harness.{name} ({'.'.join(harness._EXPORTS[name])}) has no docstring"


def test_gen_mutants_renders_a_run_and_gates_on_it(tmp_path):
    sys.path.insert(0, str(REPO / "docs"))
    try:
        import gen_mutants
    finally:
        sys.path.remove(str(REPO / "docs"))
    from harness.mutants import CATALOG

    def result(mid, killed, by=None, also=(), probe=None):
        return {"id": mid, "description": "", "status": "killed" if killed else "survived", "killed": killed, "killed_by": by,
                "killing_probe": probe, "seconds": 1.0, "failed_properties": ([by] if by else []) + list(also),
                "first_failure": "", "probes_run": [], "probes_not_run": [], "error": ""}

    run = {"seconds": 3.0, "all_properties": False, "all_probes": False,
           "mutants": [result("sglang-26416", True, "P1", ("P3",), "cases"), result("bucket-floor", False)]}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    out = tmp_path / "mutants.md"
    assert gen_mutants.main([str(path), "--out", str(out)]) == 2  # two of the catalog: refused without --partial
    assert not out.exists()
    assert gen_mutants.main([str(path), "--out", str(out), "--partial"]) == 1  # one survived: the gate fails
    page = out.read_text()
    seed = next(m for m in CATALOG if m.id == "sglang-26416")
    assert f"| `sglang-26416` | {seed.kind} | " in page and "| **P1** | P3 | cases |" in page
    assert "| `bucket-floor` |" in page and "**SURVIVED**" in page
    assert "**1 of 2 killed**" in page and f"{len(CATALOG) - 2} mutants of the catalog were not run" in page
    path.write_text(json.dumps({"ok": False, "exit_code": 3, "error": {"kind": "internal", "message": "boom"}}))
    assert gen_mutants.main([str(path), "--out", str(out)]) == 1
