"""An engine's torch.compile / torch.compiler.disable decorations, deferred to the decorated function's first call.

SGLang decorates functions with torch.compile and torch.compiler.disable at import time;
either call imports TorchDynamo and Inductor, seconds of every check on a small CPU box,
although the paths engine-check drives call none of the decorated functions. defer() swaps
both, process-wide (engine-check runs one engine per process), for versions that, called
from a module of the engine's packages, keep their arguments and do the real decoration
on the decorated function's first call, then call through it. A function that is called
therefore behaves exactly as the real decoration makes it behave, from its first call on;
one never called never needed the decoration. Calls from anywhere else, and anything but a
plain function (an nn.Module, a bound method, a class), get the real decoration at once.
"""
from __future__ import annotations

import functools
import inspect
import sys
import types
from typing import Any, Callable

import torch
import torch.compiler

_ENGINE_PACKAGES: set[str] = set()


def _from_engine(depth: int) -> bool:
    name = sys._getframe(depth + 1).f_globals.get("__name__", "")
    return name.split(".")[0] in _ENGINE_PACKAGES


def deferring(real: Callable[..., Any]) -> Callable[..., Any]:
    """`real` (a decorator called with the function, or first with options only), deferred for engine callers."""

    first = next(iter(inspect.signature(real).parameters))  # torch.compile(model=f) names the function

    def decorate(fn: Any = None, *args: Any, **kwargs: Any) -> Any:
        if fn is None and first in kwargs:
            fn = kwargs.pop(first)
        if not _from_engine(1):
            return real(fn, *args, **kwargs)
        if fn is None:  # the decorator-factory form, @torch.compile(dynamic=True): applied in the same module
            return lambda f: _deferred(real, f, args, kwargs)
        return _deferred(real, fn, args, kwargs)

    decorate.real = real  # type: ignore[attr-defined]
    return decorate


def _deferred(real: Callable[..., Any], fn: Any, args: tuple, kwargs: dict) -> Any:
    if not isinstance(fn, types.FunctionType):
        return real(fn, *args, **kwargs)
    decorated: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*a: Any, **k: Any) -> Any:
        if not decorated:
            decorated.append(real(fn, *args, **kwargs))
        return decorated[0](*a, **k)

    return call


def defer(package: str) -> None:
    """From now on, `package`'s modules' torch.compile / torch.compiler.disable decorations wait for a first call."""
    _ENGINE_PACKAGES.add(package)
    if not hasattr(torch.compile, "real"):
        torch.compile = deferring(torch.compile)  # type: ignore[assignment]
    if not hasattr(torch.compiler.disable, "real"):
        torch.compiler.disable = deferring(torch.compiler.disable)  # type: ignore[assignment]
