"""The errors a run can end with besides a verdict, and the exit code each gets.

A CI reads the exit code alone, so the classes are few and fixed: 0 every property held,
1 a property failed, 2 the input or the command line is wrong (the user can fix it),
3 the harness could not run (a bug of ours, or the machine ran out of memory). A property
failure is never reported for a run that did not get to judge anything.
"""
from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """How every command ends, so a CI step can branch on the code alone: 0 every property held, 1 a property
    failed (or a golden differs, a mutant survived), 2 bad input or usage, 3 the harness could not run.
    """
    OK = 0
    PROPERTY_FAILED = 1
    BAD_INPUT = 2
    INTERNAL = 3


class UsageError(Exception):
    """A command line the harness can't act on: a message for the user, exit 2."""


class OutOfMemory(RuntimeError):
    """The run needed more memory than the machine had: no property was judged, exit 3.

    Not a user mistake that exit 2 could name a field for: the case passed the schema's
    resource budget (harness/cases/case.py), so the machine, not the case, is what ran short.
    """


_OOM_NAMES = ("MemoryError", "OutOfMemoryError")
_OOM_TEXT = ("can't allocate memory", "out of memory", "cannot allocate memory")


def is_oom(err: BaseException, name: str = "") -> bool:
    """`err` (or the rank exception it names as `name`) is an allocation failure, on CPU or GPU."""
    if isinstance(err, MemoryError) or type(err).__name__ in _OOM_NAMES or name in _OOM_NAMES:
        return True
    text = str(err).lower()
    return any(t in text for t in _OOM_TEXT)
