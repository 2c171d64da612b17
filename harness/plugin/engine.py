"""engine-check as test items of an engine team's own pytest suite.

`--specharness-engine-check="--engine sglang --target python"` (or ini `specharness_engine_check`)
holds an engine-check command line; the plugin then collects one item per (runner, layout, device
path) the check drove on that engine build (SGLang: runner x representative layout; vLLM: runner x
DP size), named `engine-check::<runner>[<layout>]`, or `<runner>[<layout>-<path>]` for the lines
of device-specific code, which also carry the marker of their path (`gpu`, `npu`): `-m "not npu"`
or `-k "not npu"` deselects the NPU path (`--path gpu` in the arguments does not even run it).
Plus one skipped item per thing the check says it did not check (never a pass). An item fails
with the failures of its lines, as the CLI prints them; with `--baseline FILE` in the arguments,
an item whose failures are all known is an expected failure (xfail) and a stale baseline entry
a warning.

The check runs once, at collection, in a process of its own (`python -m harness.engines
... --json`): loading an engine swaps module globals process-wide, so it can never run inside the
pytest process. The items are what that run reports: an item that exists was checked. Under
pytest-xdist each worker collects, so each runs the check (the same deterministic report).
An engine that could not be checked (exit 2) is a collection error with the check's message; a
release outside the adapter's reach (exit 3, N/A) is one skipped item with the reason.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import shlex
import subprocess
import sys
import warnings
from collections import defaultdict
from typing import Iterator, Optional

import pytest

from harness.engines.command import add_arguments
from harness.engines.releases import json_document
from harness.verdict import Failure, Verdict

NODE = "engine-check"
# one check of the slowest engine to import (vLLM: 15-30 s of import, seconds of checks) on a 2-core machine, with room
CHECK_TIMEOUT_S = 900
EXIT_NOT_COVERED = 3


class EngineCheckError(Exception):
    """The engine could not be checked, or an item's lines failed: reported as its text, not a traceback."""


def engine_check_args(config: pytest.Config) -> Optional[list[str]]:
    """The engine-check command line the session was given (None: no engine items), parsed by engine-check's own
    parser so a bad flag is a usage error at startup, not a collection error later."""
    raw = config.getoption("--specharness-engine-check") or config.getini("specharness_engine_check")
    if not raw:
        return None
    args = shlex.split(raw)
    parser = argparse.ArgumentParser(prog="--specharness-engine-check", exit_on_error=False)
    add_arguments(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(args)
    except (argparse.ArgumentError, SystemExit) as e:
        detail = err.getvalue().strip().splitlines()[-1:] or [str(e)]
        raise pytest.UsageError(f"--specharness-engine-check={raw!r}: {detail[0]}") from None
    if ns.releases:
        raise pytest.UsageError("--specharness-engine-check: --releases checks many releases, one process each; "
                                "a session checks one engine build (run `harness engine-check --releases` for the table)")
    if ns.write_baseline:
        raise pytest.UsageError("--specharness-engine-check: --write-baseline writes a file; run `harness engine-check ... "
                                "--write-baseline FILE` once and give the session --baseline FILE")
    return [a for a in args if a != "--json"]


def run_engine_check(args: list[str]) -> tuple[int, dict]:
    cmd = [sys.executable, "-m", "harness.engines", *args, "--json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise EngineCheckError(f"engine-check {shlex.join(args)} ran past {CHECK_TIMEOUT_S} s") from None
    try:
        doc = json_document(proc.stdout)
    except ValueError:
        raise EngineCheckError(f"engine-check {shlex.join(args)} exited {proc.returncode} without its JSON document:\n"
                               f"{proc.stderr[-3000:]}") from None
    return proc.returncode, doc


def _layout_id(line: dict) -> str:
    """SGLang names a layout with its branch ("tp4-dp2 [mlp_tp_gather]"), vLLM lines carry a DP size; a device path's
    lines add it ("tp4-dp2-npu")."""
    layout = line["layout"].split(" [")[0] if "layout" in line else f"dp{line['dp']}"
    return f"{layout}-{line['path']}" if line.get("path") else layout


def _skip_name(reason: str, taken: set[str]) -> str:
    """A short, unique item name for something not checked: its reason's first words up to a colon."""
    base = reason.split(":")[0].split(" (")[0].strip().replace(" ", "_")[:40] or "not-checked"
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


class EngineCheckNode(pytest.Collector):
    """The engine build under check: its items come from one engine-check run."""

    def __init__(self, *, args: list[str], **kw) -> None:
        super().__init__(**kw)
        self.args = args

    def collect(self) -> Iterator[pytest.Item]:
        rc, doc = run_engine_check(self.args)
        if "error" in doc:
            raise EngineCheckError(f"engine-check {shlex.join(self.args)} could not check the engine (exit {rc}): {doc['error']['message']}")
        if rc == EXIT_NOT_COVERED:
            yield NotCheckedItem.from_parent(self, name="n/a", reason=f"{doc['engine']} {doc['version']}: {doc['not_covered']}")
            return
        groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
        for line in doc["lines"]:
            groups[(line["runner"], _layout_id(line))].append(line)
        what = f"{doc['engine']} {doc['version']} from {doc['location']}"
        baseline = doc.get("baseline")
        for f in (baseline or {}).get("stale", []):
            warnings.warn(pytest.PytestWarning(f"engine-check baseline {baseline['file']}: a stale entry (checked, no longer found): {f}"),
                          stacklevel=1)
        for (runner, layout), lines in groups.items():
            item = LinesItem.from_parent(self, name=f"{runner}[{layout}]", lines=lines, what=what,
                                         baseline=None if baseline is None else baseline["file"])
            path = lines[0].get("path")
            if path:  # a device path's items carry its marker (registered here: a --strict-markers session accepts it)
                self.config.addinivalue_line("markers", f"{path}: engine-check items of the {path} device path's code")
                item.add_marker(path)
            yield item
        taken: set[str] = set()
        for reason in [*doc.get("skipped", []), *doc.get("not_applicable", [])]:
            yield NotCheckedItem.from_parent(self, name=_skip_name(reason, taken), reason=reason)

    def repr_failure(self, excinfo):  # type: ignore[override]
        return str(excinfo.value) if isinstance(excinfo.value, EngineCheckError) else super().repr_failure(excinfo)


class LinesItem(pytest.Item):
    def __init__(self, *, lines: list[dict], what: str, baseline: Optional[str] = None, **kw) -> None:
        super().__init__(**kw)
        self.lines, self.what, self.baseline = lines, what, baseline

    def runtest(self) -> None:
        failed = [ln for ln in self.lines if not ln["ok"]]
        if not failed:
            return
        failures = [f for ln in failed for f in ln["failures"]]
        new = [f for f in failures if f.get("baseline") != "known"]
        if self.baseline is not None and not new:
            pytest.xfail(f"{len(failures)} known finding(s) (baseline {self.baseline}), first: {_failure(failures[0]).message()}")
        v = Verdict(f"{self.what} ({len(failed)} of {len(self.lines)} lines failed)", sum(ln["checked"] for ln in self.lines),
                    [_failure(f) for f in new])
        known = f"\n(and {len(failures) - len(new)} known finding(s), baseline {self.baseline})" if len(new) < len(failures) else ""
        raise EngineCheckError(v.report() + known)  # the failures as a verdict prints them, the first five then the count

    def repr_failure(self, excinfo):  # type: ignore[override]
        return str(excinfo.value) if isinstance(excinfo.value, EngineCheckError) else super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"{NODE} {self.name}"


def _failure(f: dict) -> Failure:
    return Failure(**{k: v for k, v in f.items() if k != "baseline"})


class NotCheckedItem(pytest.Item):
    """What the check says it did not check: skipped with its reason, never passed."""

    def __init__(self, *, reason: str, **kw) -> None:
        super().__init__(**kw)
        self.reason = reason

    def runtest(self) -> None:
        pytest.skip(f"not checked: {self.reason}")

    def reportinfo(self):
        return self.path, None, f"{NODE} {self.name}"
