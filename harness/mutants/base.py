"""A mutant: a named, reversible patch of one behaviour (the catalog is harness.mutants)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional
from unittest import mock


@dataclass(frozen=True)
class Mutant:
    id: str
    description: str
    kind: str  # what family of bug it stands for
    patches: tuple[tuple[object, str, object], ...] = field(default=())  # (target, attribute, replacement)
    probes: Optional[tuple[str, ...]] = None  # probe ids (harness.suite.PROBES) that can see it, cheapest first; None: all

    @contextlib.contextmanager
    def planted(self) -> Iterator["Mutant"]:
        with contextlib.ExitStack() as stack:
            for target, attr, new in self.patches:
                if not hasattr(target, attr):
                    raise AttributeError(f"mutant {self.id}: {target!r} has no attribute {attr!r} to patch (the code moved?)")
                stack.enter_context(mock.patch.object(target, attr, new))
            yield self
