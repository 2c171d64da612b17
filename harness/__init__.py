"""specharness: a correctness harness for tensor-parallel speculative decoding.

The public API is what this module exports (`__all__`); everything else is internal and may
move. An engine's own test suite uses it directly, or through the pytest plugin
(harness.plugin, registered as the `specharness` pytest11 entry point).
"""

__version__ = "0.1.0"

from harness.case import Case, CaseError, default_cases, load_case  # noqa: E402
from harness.checks import CASE_PROPS, FAST_PROPS, CaseReport, check_case  # noqa: E402
from harness.engines.check import check_engine  # noqa: E402
from harness.engines.report import EngineReport  # noqa: E402
from harness.errors import ExitCode, OutOfMemory  # noqa: E402
from harness.golden import GoldenError, check_golden, record_golden  # noqa: E402
from harness.mutants import CATALOG as MUTANTS  # noqa: E402
from harness.mutants import Mutant  # noqa: E402
from harness.mutants import get as get_mutant  # noqa: E402
from harness.verdict import Failure, Verdict  # noqa: E402

__all__ = [
    "__version__",
    # cases
    "Case", "CaseError", "load_case", "default_cases",
    # checks and their verdicts
    "check_case", "CaseReport", "Verdict", "Failure", "FAST_PROPS", "CASE_PROPS",
    # goldens
    "check_golden", "record_golden", "GoldenError",
    # the mutant catalog
    "MUTANTS", "Mutant", "get_mutant",
    # an installed engine's own runners
    "check_engine", "EngineReport",
    # outcomes
    "ExitCode", "OutOfMemory",
]
