"""The property names a user selects per case, kept apart from the checks so that naming them
(argument parsing, the pytest plugin's options) does not import torch."""
from __future__ import annotations

FAST_PROPS = ("P1", "P3", "P4")  # one run of the case: the draft-extend runners
"""The properties one run of a case's graph runners decides: what `harness check` runs by default."""
SPEC_PROPS = ("P2", "P5", "P6")  # the case's workload through the speculative decoding loop
CASE_PROPS = FAST_PROPS + SPEC_PROPS  # P7 and P8 need planned schedules: pytest and `harness mutants` run them
"""Every property a single case can run (`--props all`). P7 and P8 need planned schedules, so the test suite and
the mutant catalog run them instead.
"""
