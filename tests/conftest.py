"""The suite runs the project's own pytest plugin, as a project that enables it does: one item per (shipped case x
property of one run of its runners: P1, P3, P4) and the case's golden item, under tests/conftest.py::specharness.
Its fixtures (specharness_cases, specharness_check, specharness_golden_dir) are the suite's too. Each test is made
known to the engine release gate before its fixtures run (tests/helpers/engine_releases.py)."""

import pytest

from tests.helpers import engine_releases

pytest_plugins = ["harness.plugin"]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    engine_releases.begin_test(item)  # before the fixtures: the release gate checks the engine marker of the test it serves
