"""What processes need to share the launch memo (launch_memo.py): one folder, and names for kernels that mean the
same in every process.

The folder is $SPECHARNESS_LAUNCH_MEMO_DIR (the test suite sets one for each run). The launch memo keys a launch by
the kernel's function object, which means nothing to another process; shared, a launch is keyed by the kernel's
identity instead, which two processes work out alike for the same kernel and differently for a changed one -- an
engine release and its planted copies are checked side by side, each in a process of its own. An interpreted kernel
is Python run over Triton's language, so what it can depend on is:

* its own code and the code of every function it calls: each is named by the text of the file that defines it
  (a planted copy rewrites a line of that file; the whole file, so that an edit anywhere in it counts);
* every global its code names (a constexpr set elsewhere, which a planted copy may change in another file), by
  value; a called function's globals likewise, down the call graph;
* Triton itself (its version): the language's modules are the interpreter's.

A global of any other kind (an object, a module of the engine's own, a closure) could change what the kernel does in
ways its value's text would not show, so such a kernel gets no identity (None): its launches are memoized within the
process only, as before. The standard library alone at import: the suite's configuration reads the variable's name.
"""
from __future__ import annotations

import builtins
import dis
import functools
import hashlib
import importlib
import os
import types
from pathlib import Path
from typing import Any, Optional

SHARED_MEMO_ENV = "SPECHARNESS_LAUNCH_MEMO_DIR"  # a folder the processes of one run share their launch effects through


def shared_folder() -> Optional[Path]:
    """$SPECHARNESS_LAUNCH_MEMO_DIR, read at each launch (a test run sets it after the engine modules are imported)."""
    folder = os.environ.get(SHARED_MEMO_ENV)
    return Path(folder) if folder else None


_SCALARS = (int, float, bool, str, bytes, type(None))
# modules a kernel may name (tl, triton, math): their code is the installed Triton's and Python's, the same in every
# process of one environment (the identity holds Triton's version)
_SHARED_MODULES = ("triton", "math")
_MISSING = object()
_FILES: dict[str, str] = {}  # file -> its text's digest, once per process (a planted copy is a file of its own)


class _NoIdentity(Exception):
    """The kernel reads something whose text does not pin what it does."""


def kernel_identity(fn: Any) -> Optional[str]:
    """A digest of everything `fn` (the kernel's Python function, as Triton's interpreter runs it) can depend on besides
    its arguments; None where that cannot be pinned down (the module docstring)."""
    # Triton as the launch found it imported: this module must not import it first (the engines' loaders set
    # TRITON_INTERPRET before Triton's first import)
    tl = importlib.import_module("triton.language")
    parts: list[str] = [f"triton {importlib.import_module('triton').__version__}"]
    try:
        _walk(fn, parts, set(), tl)
    except _NoIdentity:
        return None
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _walk(fn: Any, parts: list[str], seen: set[int], tl: types.ModuleType) -> None:
    fn = getattr(fn, "fn", fn)  # a JITFunction or InterpretedFunction: the Python function it wraps
    if not isinstance(fn, types.FunctionType):
        raise _NoIdentity(repr(fn))
    if id(fn) in seen:
        return
    seen.add(id(fn))
    if fn.__closure__:
        raise _NoIdentity(f"{fn.__qualname__} closes over variables")
    code = fn.__code__
    parts.append(f"def {fn.__module__}.{fn.__qualname__} in {_file_digest(code.co_filename)}")
    for default in (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()):
        parts.append(f"  default {_value_text(default, tl)}")
    interpreter = importlib.import_module("triton.runtime.interpreter").__dict__
    for name in sorted(_global_names(code)):
        if name in fn.__globals__:
            value = fn.__globals__[name]
            if interpreter.get(name, _MISSING) is value:  # what the interpreter's rewrite of the kernel calls (its module's own)
                parts.append(f"  {name} = the interpreter's")
            elif isinstance(value, types.ModuleType):
                if value.__name__.partition(".")[0] not in _SHARED_MODULES:
                    raise _NoIdentity(f"{fn.__qualname__} names the module {value.__name__}")
                parts.append(f"  {name} = module {value.__name__}")
            elif isinstance(value, types.FunctionType) or hasattr(value, "fn"):
                parts.append(f"  {name} = function")
                _walk(value, parts, seen, tl)
            else:
                parts.append(f"  {name} = {_value_text(value, tl)}")
        elif not hasattr(builtins, name):
            parts.append(f"  {name} unbound")  # a NameError if the kernel reaches it


@functools.lru_cache(maxsize=None)
def _global_names(code: types.CodeType) -> frozenset[str]:
    """The globals the code and its nested code (comprehensions, inner functions) load; attribute names (tl.load's
    `load`) are not among them."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return frozenset(names)


def _value_text(value: Any, tl: types.ModuleType) -> str:
    if isinstance(value, tl.constexpr):
        return f"constexpr {_value_text(value.value, tl)}"
    if isinstance(value, _SCALARS):
        return f"{type(value).__name__} {value!r}"
    if isinstance(value, tl.dtype):
        return f"dtype {value}"
    if isinstance(value, tuple) and type(value) is tuple:
        return "(" + ", ".join(_value_text(v, tl) for v in value) + ")"
    raise _NoIdentity(f"a global of type {type(value).__name__}")


def _file_digest(path: str) -> str:
    digest = _FILES.get(path)
    if digest is None:
        if not Path(path).is_file():  # code compiled from a string ("<string>"): no text to name it by
            raise _NoIdentity(f"code from {path}, not a file")
        digest = _FILES[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return digest
