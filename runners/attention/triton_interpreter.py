"""Triton's interpreter made cheaper where it does work nobody reads, without changing what a kernel computes.

On CPU every Triton kernel, ours (runners/attention) and the engines' (harness engine-check), runs in Triton's
interpreter, which pays per operation for two things whose results never change or are never used:

* Triton's semantic layer recomputes every 32-bit integer add, sub and mul in 64 bits to build the range condition
  of a device_assert, which drops it unless the builder's options say debug (the interpreter's never do);
* the interpreter rebuilds its whole numpy dtype table on every dtype lookup (several per operation), and lists the
  builtins of triton.language with inspect.getmembers on every launch and every device-function call.

`speed_up_interpreter()` skips the first where the assertion is dropped and remembers the second. Both are
idempotent and leave a compiling (GPU) build alone.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any

import numpy as np


def speed_up_interpreter() -> None:
    skip_dropped_overflow_checks()
    remember_interpreter_lookups()


def remember_interpreter_lookups() -> None:
    """The interpreter's dtype table and its list of triton.language builtins, each computed once instead of per call. The
    builtins of a module or class are listed the first time a launch rebinds them, before anything has rebound them; each
    later launch rebinds those names whose member is still a builtin, which is what a full scan finds (a name rebound and
    never restored, as a device-function call leaves it, holds a wrapper, no builtin, either way). Idempotent."""
    interp = importlib.import_module("triton.runtime.interpreter")
    if getattr(interp._get_np_dtype, "__specharness_memo__", False):
        return
    tl, get_np_dtype, patch_attr = interp.tl, interp._get_np_dtype, interp._patch_attr
    np_dtypes: dict[Any, np.dtype] = {}

    def np_dtype(tt_dtype: Any) -> np.dtype:
        if isinstance(tt_dtype, tl.block_type) and not isinstance(tt_dtype.element_ty, tl.pointer_type):
            tt_dtype = tt_dtype.element_ty  # the table maps a block to its element's dtype (a block type is unhashable)
        if isinstance(tt_dtype, (tl.pointer_type, tl.block_type)):
            return get_np_dtype(tt_dtype)
        found = np_dtypes.get(tt_dtype)
        if found is None:
            found = np_dtypes[tt_dtype] = get_np_dtype(tt_dtype)
        return found

    builtin_names: dict[Any, list[str]] = {}

    def patch_builtin(pkg: Any, builder: Any, scope: Any) -> None:
        names = builtin_names.get(pkg)
        if names is None:
            names = builtin_names[pkg] = [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
        for name in names:
            member = getattr(pkg, name, None)
            if tl.core.is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    np_dtype.__specharness_memo__ = True  # type: ignore[attr-defined]
    interp._get_np_dtype, interp._patch_builtin = np_dtype, patch_builtin


def skip_dropped_overflow_checks() -> None:
    """Triton's semantic layer builds each integer add/sub/mul's overflow condition only for device_assert, which returns
    before using it when the builder's options are not debug: on the interpreter's builder, skip building it then (with
    debug on, and on a compiling builder, it runs as before). The interpreter makes a semantic object per builtin it
    patches, so the class's method is the one to wrap. Idempotent."""
    interp = importlib.import_module("triton.runtime.interpreter")
    semantic_cls = interp.TritonSemantic
    original = semantic_cls.binary_op_sanitize_overflow_impl
    if getattr(original, "__specharness_skip__", False):
        return
    interpreter_builder = interp.InterpreterBuilder

    def sanitize_overflow(self: Any, lhs: Any, rhs: Any, binary_op: Any) -> None:
        if isinstance(self.builder, interpreter_builder) and not self.builder.options.debug:
            return
        original(self, lhs, rhs, binary_op)

    sanitize_overflow.__specharness_skip__ = True  # type: ignore[attr-defined]
    semantic_cls.binary_op_sanitize_overflow_impl = sanitize_overflow
