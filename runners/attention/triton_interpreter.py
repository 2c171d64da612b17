"""Triton's interpreter made cheaper where it does work nobody reads, without changing what a kernel computes.

On CPU every Triton kernel, ours (runners/attention) and the engines' (harness engine-check), runs in Triton's
interpreter, which pays per operation for two things whose results never change or are never used:

* Triton's semantic layer recomputes every 32-bit integer add, sub and mul in 64 bits to build the range condition
  of a device_assert, which drops it unless the builder's options say debug (the interpreter's never do);
* the interpreter rebuilds its whole numpy dtype table on every dtype lookup (several per operation), lists the
  builtins of triton.language with inspect.getmembers and makes a wrapper for each on every launch and every
  device-function call, and types every triton.language tuple it makes (a tensor's shape is one) and spells out that
  type's printable name, for tuples whose type is almost never read.

`speed_up_interpreter()` skips the first where the assertion is dropped, remembers the lookups and wrappers, and
types a tuple, and names a tuple type, when that is first read. All are idempotent and leave a compiling (GPU) build
alone.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

import numpy as np


def speed_up_interpreter() -> None:
    skip_dropped_overflow_checks()
    remember_interpreter_lookups()
    name_tuple_types_on_use()
    type_tuples_on_use()


def type_tuples_on_use() -> None:
    """A triton.language tuple made without a type works its type out of its members when made; the interpreter makes
    one for every tensor (its shape) and reads the type of almost none. Work it out when first read instead, by
    Triton's own function, from the members the tuple holds then: the members it was made with, since the one method
    that replaces a member (_setitem) assigns the type again itself. A type given at construction is kept as given.
    Idempotent."""
    core = importlib.import_module("triton.language.core")
    cls = core.tuple
    if isinstance(cls.__dict__.get("type"), functools.cached_property):
        return
    tuple_type, type_of = core.tuple_type, core._type_for_tuple_values

    def init(self: Any, args: Any, type: Any = None) -> None:  # noqa: A002 - Triton's own parameter name
        self.values = [i for i in args]
        if type is not None:  # an assignment stores it in the instance, over the class's cached_property
            self.type = type if isinstance(type, tuple_type) else tuple_type(type)

    def typed(self: Any) -> Any:
        return type_of(self.values)

    cls.__init__ = init
    cls.type = functools.cached_property(typed)
    cls.type.__set_name__(cls, "type")


def name_tuple_types_on_use() -> None:
    """triton.language's tuple_type spells out its printable name (each member's repr) when it is made; the interpreter
    makes one for every tensor it creates (a tensor's shape is a triton.language tuple) and prints almost none. Make the
    name when first read instead, by Triton's own constructor, from the members it was made with. Idempotent."""
    core = importlib.import_module("triton.language.core")
    cls = core.tuple_type
    if isinstance(cls.__dict__.get("name"), functools.cached_property):
        return
    make = cls.__init__

    def init(self: Any, types: Any, fields: Any = None) -> None:
        self.types = types
        self.fields = fields or [""] * len(types)
        self._made_with = fields

    def name(self: Any) -> str:
        made = object.__new__(cls)
        make(made, self.types, self._made_with)
        return made.name

    cls.__init__ = init
    cls.name = functools.cached_property(name)
    cls.name.__set_name__(cls, "name")


def remember_interpreter_lookups() -> None:
    """The interpreter's dtype table and its list of triton.language builtins, each computed once instead of per call. The
    builtins of a module or class are listed the first time a launch rebinds them, before anything has rebound them; each
    later launch rebinds those names whose member is still a builtin, which is what a full scan finds (a name rebound and
    never restored, as a device-function call leaves it, holds a wrapper, no builtin, either way). The wrapper a name is
    rebound to is made once per builtin and builder by the interpreter's own code, and bound again on each later launch:
    it holds only the builtin and a semantic object over the builder, which keeps no state of its own. Idempotent."""
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
    wrappers: dict[tuple[Any, str], tuple[Any, Any, Any]] = {}  # (pkg, name) -> (builtin, builder, the wrapper made for them)

    def patch_builtin(pkg: Any, builder: Any, scope: Any) -> None:
        names = builtin_names.get(pkg)
        if names is None:
            names = builtin_names[pkg] = [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
        for name in names:
            member = getattr(pkg, name, None)
            if tl.core.is_builtin(member):
                made = wrappers.get((pkg, name))
                if made is None or made[0] is not member or made[1] is not builder:
                    made = wrappers[(pkg, name)] = (member, builder, _made_wrapper(patch_attr, pkg, name, member, builder))
                scope.set_attr(pkg, name, made[2])

    np_dtype.__specharness_memo__ = True  # type: ignore[attr-defined]
    interp._get_np_dtype, interp._patch_builtin = np_dtype, patch_builtin


class _Kept:
    """A patch scope that keeps the value instead of setting it."""

    value: Any = None

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        self.value = value


def _made_wrapper(patch_attr: Any, pkg: Any, name: str, member: Any, builder: Any) -> Any:
    kept = _Kept()
    patch_attr(pkg, name, member, builder, kept)
    return kept.value


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
