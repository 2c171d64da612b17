"""The pytest plugin: every (case x property) of specharness as a test item of an engine's own suite, and an engine
build's engine-check lines as items. Enable it with one line in the project's top-level conftest.py:

    pytest_plugins = ["harness.plugin"]

The case items test the reference runners shipped with specharness (or the cases you add for them); only
`--specharness-engine-check` tests your engine build. The wheel's pytest11 entry point registers only
harness.plugin.options, which every pytest session of the environment loads, so this package imports nothing heavy:
the items live in harness.plugin.cases and harness.plugin.engine, loaded through the list below.
"""
pytest_plugins = ["harness.plugin.options", "harness.plugin.cases"]
