"""A mutant: a named, reversible patch of one behaviour (the catalog is harness.mutants)."""
from __future__ import annotations

import contextlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional
from unittest import mock

# Ids of the mutants planted in this process now, in planting order: what must not be recorded as a golden, and what
# spawned rank processes plant again (harness.ranks.launcher passes it in their environment).
_PLANTED: list[str] = []
PLANTED_ENV = "SPECHARNESS_PLANTED_MUTANTS"


def planted_ids() -> tuple[str, ...]:
    """The mutants planted in this process now (empty: the code as written)."""
    return tuple(_PLANTED)


@dataclass(frozen=True)
class Wrap:
    """A replacement built from the real attribute when the mutant is planted: a patch whose target is named lazily
    (a string) has no real method to call until then."""

    make: Callable[[Any], Any]  # the real attribute -> its replacement


@dataclass(frozen=True)
class Mutant:
    """A named, reversible patch of one behaviour of `runners/`, standing for one bug. `planted()` applies the
    patches for the length of a `with` block and undoes them, so a property is shown to fail on the bug without
    a file being edited; `probes` names the checks that can see it, cheapest first, so `harness mutants` runs
    only those.
    """
    id: str
    description: str
    kind: str  # what family of bug it stands for
    # (target, attribute, replacement); a str target ("pkg.mod:Class") is imported when planted, as mock.patch("pkg.mod.Class.attr")
    # does, so the catalog can name code in a module that imports an optional package (triton) without importing it
    patches: tuple[tuple[object, str, object], ...] = field(default=())
    # probe ids that can see it, cheapest first (the properties' probes and the case probes: harness.pipeline.mutants.probes()); None: all
    probes: Optional[tuple[str, ...]] = None

    @contextlib.contextmanager
    def planted(self) -> Iterator["Mutant"]:
        with contextlib.ExitStack() as stack:
            for target, attr, new in self.patches:
                if isinstance(target, str):
                    target = pkgutil.resolve_name(target)
                if not hasattr(target, attr):
                    raise AttributeError(f"mutant {self.id}: {target!r} has no attribute {attr!r} to patch (the code moved?)")
                if isinstance(new, Wrap):
                    new = new.make(getattr(target, attr))
                stack.enter_context(mock.patch.object(target, attr, new))
            _PLANTED.append(self.id)
            stack.callback(_PLANTED.remove, self.id)
            yield self


def keeps(real: Callable[..., Any], *buffers: str) -> Callable[..., Any]:
    """`real` (a graph runner's replay-fill or copy-in method) with its writes to the named static buffers undone:
    they keep what they held before the call (a larger batch's padded lanes, the last replay's live lanes)."""
    def method(self: Any, *args: Any) -> Any:
        holder = getattr(self, "buffers", self)  # the draft-extend runners keep theirs in an InputBuffers set
        saved = [(buf, buf.clone()) for buf in (getattr(holder, b) for b in buffers) if buf is not None]  # None: a branch without it
        out = real(self, *args)
        for buf, old in saved:
            buf.copy_(old)
        return out

    return method
