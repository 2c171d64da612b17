"""Mutant.planted with a target named by string: resolved at plant time, the Wrap built from the real attribute,
everything restored after, and a moved attribute refused with the mutant's id."""
from __future__ import annotations

import pytest

from harness.mutants import Mutant, Wrap


class _Thing:
    def value(self) -> int:
        return 2


_TARGET = f"{__name__}:_Thing"


def test_a_string_target_is_patched_with_a_wrap_of_the_real_method():
    m = Mutant("times-ten", "value times ten", "test", ((_TARGET, "value", Wrap(lambda real: lambda self: real(self) * 10)),))
    with m.planted():
        assert _Thing().value() == 20
    assert _Thing().value() == 2


def test_a_string_target_without_the_attribute_names_the_mutant():
    m = Mutant("moved", "patches a method that is gone", "test", ((_TARGET, "gone", lambda self: 0),))
    with pytest.raises(AttributeError, match=r"mutant moved: .*_Thing.* has no attribute 'gone' to patch \(the code moved\?\)"):
        with m.planted():
            pass
