"""The suite runs the project's own pytest plugin, as a project that enables it does: one item per (shipped case x
property of one run of its runners: P1, P3, P4) and the case's golden item, under tests/conftest.py::specharness.
Its fixtures (specharness_cases, specharness_check, specharness_golden_dir) are the suite's too."""

pytest_plugins = ["harness.plugin"]
