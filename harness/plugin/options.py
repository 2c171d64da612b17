"""The pytest plugin's options: what the wheel's pytest11 entry point loads into every pytest session.

An entry point is loaded by every pytest run in the environment, also in projects that never use
specharness, so it stays light (no torch, no model): it only declares the options and ini keys.
harness.plugin, which a project's conftest enables, brings the items and fixtures and pulls this
module in through its `pytest_plugins`, so the options exist however the plugin was loaded.
"""
from __future__ import annotations

import pytest

from harness.cases.data import shipped_dir


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("specharness", "specharness: speculative decoding correctness properties")
    g.addoption("--specharness-cases-dir", metavar="DIR",
                help=f"the cases to run (default: ini specharness_cases_dir, else the shipped ones: {shipped_dir('cases')}); "
                     "their goldens are in DIR/golden/")
    g.addoption("--specharness-golden-dir", metavar="DIR",
                help="where the array goldens are (default: ini specharness_golden_dir, else beside the cases: DIR/golden/ of "
                     "--specharness-cases-dir, the shipped ones for the shipped cases); P6's acceptance goldens are always beside the cases")
    g.addoption("--specharness-props", metavar="LIST",
                help="properties per case: a comma list of property ids or 'all' (default: those of one run of the case's runners; "
                     "`harness check --help` lists them)")
    g.addoption("--specharness-force-regen", action="store_true",
                help="rewrite the goldens the selected properties read and fail their items (never under pytest-xdist, never with "
                     "--specharness-mutant, never into the installed package)")
    g.addoption("--specharness-mutant", metavar="ID", help="plant a mutant of the catalog for the whole session (see `harness mutants`)")
    g.addoption("--specharness-engine-check", metavar="ARGS",
                help="an engine-check command line (e.g. \"--engine sglang --target python\"): check that engine build and "
                     "collect one item per (runner, layout) it drove (harness.plugin.engine)")
    parser.addini("specharness_engine_check", "engine-check arguments, as --specharness-engine-check", default="")
    parser.addini("specharness_cases_dir", "directory of case files (relative to the ini file)", type="paths", default=[])
    parser.addini("specharness_golden_dir", "directory of goldens (relative to the ini file)", type="paths", default=[])
    parser.addini("specharness_props", "properties per case, as --specharness-props (empty: the default)", default="")
