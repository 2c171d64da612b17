"""specharness: a correctness harness for tensor-parallel speculative decoding.

The public API is what this module exports (`__all__`); everything else is internal and may
move. An engine's own test suite uses it directly, or through the pytest plugin
(harness.plugin, enabled by a conftest line; the wheel's pytest11 entry point loads only its
options, harness.plugin.options).

The names are resolved on first use (PEP 562): importing any harness module imports this
package first, and the entry point above is imported by every pytest session of an environment
where the wheel is installed, so the package itself must not pull in torch and the model.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

# public name -> (module, attribute there)
_EXPORTS: dict[str, tuple[str, str]] = {
    "Case": ("harness.cases.case", "Case"),
    "CaseError": ("harness.cases.case", "CaseError"),
    "load_case": ("harness.cases.case", "load_case"),
    "default_cases": ("harness.cases.case", "default_cases"),
    "check_case": ("harness.pipeline.check", "check_case"),
    "CaseReport": ("harness.pipeline.check", "CaseReport"),
    "Verdict": ("harness.verdict", "Verdict"),
    "Failure": ("harness.verdict", "Failure"),
    "FAST_PROPS": ("harness.props.registry", "FAST_PROPS"),
    "CASE_PROPS": ("harness.props.registry", "CASE_PROPS"),
    "check_golden": ("harness.golden", "check_golden"),
    "record_golden": ("harness.golden", "record_golden"),
    "GoldenError": ("harness.golden", "GoldenError"),
    "MUTANTS": ("harness.mutants", "CATALOG"),
    "Mutant": ("harness.mutants", "Mutant"),
    "get_mutant": ("harness.mutants", "get"),
    "check_engine": ("harness.engines.check", "check_engine"),
    "EngineReport": ("harness.engines.report", "EngineReport"),
    "ExitCode": ("harness.errors", "ExitCode"),
    "OutOfMemory": ("harness.errors", "OutOfMemory"),
}

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


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # resolved once: later lookups never reach __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
