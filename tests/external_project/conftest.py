pytest_plugins = ["harness.plugin"]  # specharness: every (case x property) of the shipped cases as a test
