"""Strict stand-ins for the worker, model runner and process groups the runners read.

Reading an attribute a stand-in lacks raises MissingEngineAttribute naming the owner and
the attribute: a release that moves something fails saying what it now reads (exit 2),
instead of silently absorbing it.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from harness.engines.drive import Strict as BaseStrict
from harness.engines.sglang.errors import MissingEngineAttribute, require


class Strict(BaseStrict):
    engine = "the engine"
    where = "harness/engines/sglang/build.py"


def noop(*args: Any, **kwargs: Any) -> None:
    return None


class FakeGroup:
    """A process group of one axis: sizes and ranks only; any collective is an adapter error."""

    def __init__(self, name: str, world_size: int, rank_in_group: int) -> None:
        self.name, self.world_size, self.rank_in_group = name, world_size, rank_in_group
        self.rank = rank_in_group

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise MissingEngineAttribute(f"the engine used {self.name}_group.{name}; the adapter's groups have sizes and ranks only")


@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any, version: str, why: str) -> Iterator[None]:
    """Swap obj.name for the duration (it must exist in this release: else the error names it)."""
    old = require(obj, name, version, why)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)
