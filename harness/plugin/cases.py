"""The plugin's case items (harness.plugin enables them): every (case x property) as a test item.

Items live under the conftest's directory as `<dir>::specharness::<case>::<property>`, so `pytest -k tp4_attn_tp_gather`
selects one case, `-k P3` one property, and `--lf` reruns what failed. Each case also gets a
`golden` item: its graph run against its golden, beside the case (the shipped goldens for the shipped
cases, else <cases-dir>/golden/; --specharness-golden-dir overrides). `--specharness-force-regen` rewrites
the goldens the selected properties read and fails those items (as pytest-regressions' --force-regen does);
it is refused under pytest-xdist, whose workers would race on the files, with a mutant planted, and for the
shipped goldens of an installed package (read-only data: use a cases dir of your own).

With `--specharness-engine-check="ARGS"` it also checks an engine build (engine-check ARGS) and collects its
lines as items under `<dir>::specharness::engine-check` (harness.plugin.engine).

Fixtures: `specharness_cases` (the configured cases), `specharness_check` (run properties on a
case, optionally with a mutant planted) and `specharness_golden_dir`.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import pytest

from harness.cases.case import CASES_DIR, Case, CaseError, default_cases, load_case
from harness.golden import GoldenError, check_golden
from harness.golden.base import GoldenKind
from harness.golden.case_goldens import needed_kinds, record_case_goldens
from harness.golden.place import PYTEST_FLAGS, case_golden_dir, check_writable, golden_dir_for
from harness.mutants import get as get_mutant
from harness.pipeline.check import CaseReport, check_case, parse_props
from harness.plugin.engine import NODE as ENGINE_NODE
from harness.plugin.engine import EngineCheckNode, engine_check_args
from harness.props import registry
from harness.props.p6 import P6

PLUGIN = "harness.plugin"
GOLDEN_ITEM = "golden"


def _dir(config: pytest.Config, name: str) -> Optional[Path]:
    given = config.getoption(f"--specharness-{name.replace('_', '-')}")
    if given:
        return Path(given).resolve()
    ini = config.getini(f"specharness_{name}")
    return Path(ini[0]) if ini else None


def _cases_dir(config: pytest.Config) -> Path:
    return _dir(config, "cases_dir") or CASES_DIR


def _golden_dir(config: pytest.Config) -> Optional[Path]:
    """The configured golden dir; None: each case's goldens beside it (harness.golden.place)."""
    return _dir(config, "golden_dir")


def pytest_configure(config: pytest.Config) -> None:
    force_regen = config.getoption("--specharness-force-regen")
    if force_regen and (os.environ.get("PYTEST_XDIST_WORKER") or getattr(config.option, "numprocesses", None)):
        raise pytest.UsageError("--specharness-force-regen is refused under pytest-xdist: workers would race on the goldens; rerun without -n")
    if force_regen and config.getoption("--specharness-mutant"):  # exit 2, as the harness's own refusal
        pytest.exit(f"--specharness-force-regen is refused with --specharness-mutant {config.getoption('--specharness-mutant')}: "
                    "the goldens would hold the mutant's bug as the expected result; rerun without --specharness-mutant", returncode=2)
    try:
        parse_props(config.getoption("--specharness-props") or config.getini("specharness_props"))
    except ValueError as e:
        raise pytest.UsageError(f"--specharness-props: {e}") from None
    engine_check_args(config)  # a bad engine-check command line is a usage error now, not at collection
    mutant_id = config.getoption("--specharness-mutant")
    if mutant_id:
        try:
            mutant = get_mutant(mutant_id)
        except KeyError as e:
            raise pytest.UsageError(f"--specharness-mutant: {e.args[0]}") from None
        stack = contextlib.ExitStack()
        stack.enter_context(mutant.planted())
        config.add_cleanup(stack.close)


@pytest.fixture(scope="session")
def specharness_cases(pytestconfig: pytest.Config) -> list[Case]:
    return default_cases(_cases_dir(pytestconfig))


@pytest.fixture(scope="session")
def specharness_golden_dir(pytestconfig: pytest.Config) -> Path:
    """Where the configured cases' goldens are: --specharness-golden-dir, else beside the cases."""
    return _golden_dir(pytestconfig) or golden_dir_for(_cases_dir(pytestconfig))


@pytest.fixture
def specharness_check(pytestconfig: pytest.Config) -> Callable[..., CaseReport]:
    """check(case or name, props=None (those of one case run), mutant=None) -> CaseReport (report.ok, report.verdicts)."""
    cases_dir = _cases_dir(pytestconfig)

    def check(case: Case | str, props: Optional[Sequence[str]] = None, mutant: Optional[str] = None) -> CaseReport:
        case = case if isinstance(case, Case) else load_case(case, cases_dir)
        with get_mutant(mutant).planted() if mutant else contextlib.nullcontext():
            return check_case(case, props=props)

    return check


def _declares_plugin(config: pytest.Config, conftest: Path) -> bool:
    for plugin in config.pluginmanager.get_plugins():
        if getattr(plugin, "__file__", None) and Path(plugin.__file__).resolve() == conftest.resolve():
            wanted = getattr(plugin, "pytest_plugins", ())
            return PLUGIN in ([wanted] if isinstance(wanted, str) else list(wanted))
    return False


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> Optional[pytest.Collector]:
    if file_path.name == "conftest.py" and _declares_plugin(parent.config, file_path):
        return Suite.from_parent(parent, name="specharness")
    return None


class SpecharnessItemError(Exception):
    """A property failed or a golden differs: reported as its text, not a traceback into the harness."""


class Suite(pytest.Collector):
    def collect(self) -> Iterator[pytest.Collector]:
        cases_dir = _cases_dir(self.config)
        paths = sorted(cases_dir.glob("*.toml")) if cases_dir.is_dir() else []
        if not paths:
            raise CaseError(cases_dir, "<cases>", "a directory of case files (*.toml): set --specharness-cases-dir or ini specharness_cases_dir")
        for path in paths:
            yield CaseNode.from_parent(self, name=path.stem, path=path)
        engine_args = engine_check_args(self.config)
        if engine_args is not None:
            yield EngineCheckNode.from_parent(self, name=ENGINE_NODE, args=engine_args)

    def repr_failure(self, excinfo):  # type: ignore[override]
        return str(excinfo.value) if isinstance(excinfo.value, (CaseError, GoldenError)) else super().repr_failure(excinfo)


class CaseNode(pytest.Collector):
    """One case: its property items share one run of the case (P1/P3/P4 need the same runs)."""

    def __init__(self, *, path: Path, **kw) -> None:
        super().__init__(path=path, **kw)
        self.case_path = path
        self._report: Optional[CaseReport] = None
        self._case: Optional[Case] = None

    def collect(self) -> Iterator[pytest.Item]:
        self._case = load_case(self.case_path)
        props = parse_props(self.config.getoption("--specharness-props") or self.config.getini("specharness_props"))
        for prop in props:
            yield PropertyItem.from_parent(self, name=prop)
        yield PropertyItem.from_parent(self, name=GOLDEN_ITEM)

    def repr_failure(self, excinfo):  # type: ignore[override]
        return str(excinfo.value) if isinstance(excinfo.value, CaseError) else super().repr_failure(excinfo)

    @property
    def case(self) -> Case:
        assert self._case is not None
        return self._case

    def report(self) -> CaseReport:
        """The case checked once, for every property of it that this session runs."""
        if self._report is None:
            selected = {it.name for it in self.session.items if it.parent is self and it.name != GOLDEN_ITEM}
            self._report = check_case(self.case, props=tuple(p for p in registry.case_ids() if p in selected))
        return self._report


class PropertyItem(pytest.Item):
    parent: CaseNode

    def runtest(self) -> None:
        if self.name == GOLDEN_ITEM:
            self._golden()
            return
        rep = self.parent.report()
        if self.name in rep.skipped:
            pytest.skip(f"{self.name} can't run on {rep.case}: {rep.skipped[self.name]}")
        run = rep.verdicts.get("run")
        if run is not None and not run.ok:
            raise SpecharnessItemError(f"{rep.case} ({rep.layout}): the run did not finish, {self.name} not judged\n{run.report()}")
        v = rep.verdicts[self.name]
        if not v.ok:
            raise SpecharnessItemError(f"{rep.case} ({rep.layout}):\n{v.report()}")

    def _golden(self) -> None:
        golden_dir = _golden_dir(self.config)
        case = self.parent.case
        if self.config.getoption("--specharness-force-regen"):
            check_writable(golden_dir or case_golden_dir(case), flags=PYTEST_FLAGS)
            props = parse_props(self.config.getoption("--specharness-props") or self.config.getini("specharness_props"))
            outcomes = record_case_goldens(case, golden_dir, [GoldenKind.ARRAYS], say=lambda _: None)
            if P6 in props:  # P6 reads the loop's goldens, always beside the case (--specharness-golden-dir is the arrays')
                outcomes += record_case_goldens(case, None, [k for k in needed_kinds(case) if k is not GoldenKind.ARRAYS], say=lambda _: None)
            if any(o.changed or not o.recorded for o in outcomes):
                text = "\n".join(o.text for o in outcomes if o.changed or not o.recorded)
                raise SpecharnessItemError(f"--specharness-force-regen: {text}\nrerun without --specharness-force-regen")
            return
        cmp = check_golden(case, golden_dir, runs=self.parent.report().runs)
        if not cmp.ok:
            raise SpecharnessItemError(cmp.format() + f"\nif the change is intended: pytest --specharness-force-regen -k {case.name}"
                                       " (with the same --specharness-cases-dir / --specharness-golden-dir, without -n)")

    def repr_failure(self, excinfo):  # type: ignore[override]
        if isinstance(excinfo.value, (SpecharnessItemError, GoldenError, CaseError)):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.parent.case_path, None, f"specharness {self.parent.name} {self.name}"
