"""Triton's interpreter, as the engine adapters run the engines' kernels with it on CPU tensors.

`prepare_interpreter()` makes four changes to it, all idempotent:

* an index fix (numpy 2 refuses int() of a 1-element array, which loop bounds loaded from memory need);
* the speed-ups our own kernels run with too (runners/attention/triton_interpreter.py: no overflow
  condition built where its assertion is dropped, tuple types named when first read, the dtype table
  and the builtins a launch rebinds remembered);
* a memory guard. The interpreter turns a kernel's pointers into raw addresses and loads and
  stores through them with no bounds: a kernel bug that computes an offset past its buffer
  writes into whatever the heap holds there, and the checker dies (`munmap_chunk(): invalid
  pointer`, a segfault) with no verdict -- the very bug it exists to report. So every masked
  load, store and atomic of a launch is checked, before it touches memory, against the storages
  of that launch's tensor arguments (the only memory a Triton kernel can address). The lanes
  outside all of them are masked off (a load reads the `other` value, a store writes nothing)
  and the access is recorded in VIOLATIONS, naming the kernel, the program, the operation and
  the argument it ran past; the kernel runs on, so the checks after it still see what the rest
  of it did, and the call that launched it records each violation as a finding
  (harness/engines/guard.py). An access that cannot be masked (a compare-and-swap has no mask)
  raises OutOfBoundsAccess instead. A kernel that makes a pointer from an integer it loaded (a
  pointer table) may also reach any live tensor's storage: to find those without scanning the
  heap, torch.Tensor.data_ptr is wrapped, process-wide, to note the tensors asked (_LiveStorages).
  In-process on purpose: the check costs a few numpy operations per access (the interpreter
  already spends milliseconds per program), where a child process per launch would pay a
  process and lose the launch memo (sglang/fill.py). Torch's own CPU indexing checks its
  bounds and raises, so the engines' gathers and scatters need no such guard.
* a launch memo (launch_memo.py): a launch on exactly the state a clean launch of the same kernel,
  grid and options ran on writes back that launch's effect instead of being interpreted again. A
  launch that went through a pointer made from an integer, made an integer from a pointer, printed,
  or had an access masked off is never kept, so every launch the guard has something to say about runs.
"""
from __future__ import annotations

import bisect
import gc
import importlib
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Hashable, Optional

import numpy as np
import torch

from harness.engines.launch_memo import LaunchMemo
from harness.engines.shared_memo import kernel_identity, shared_folder
from runners.attention.triton_interpreter import speed_up_interpreter


class OutOfBoundsAccess(RuntimeError):
    """An interpreted kernel reached for memory outside every tensor argument of its launch, where no mask can drop it."""


@dataclass(frozen=True)
class Violation:
    """One out-of-bounds access of one launch, masked off before it touched memory."""

    kernel: str
    op: str
    argument: str
    message: str


_MIN, _MAX = np.minimum.reduce, np.maximum.reduce  # ndarray.min/max less their Python-level argument handling

# every violation as it happens, in order; guard.guarded takes those of its call (and removes them)
VIOLATIONS: list[Violation] = []


@dataclass
class _Launch:
    """One interpreted launch: its kernel and the byte ranges [start, end) of its tensor arguments' storages."""

    kernel: str
    starts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    ends: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    names: list[str] = field(default_factory=list)
    start_list: list[int] = field(default_factory=list)  # starts and ends as Python ints, for check()'s scalar bisect
    end_list: list[int] = field(default_factory=list)
    indirect: bool = False  # the kernel made a pointer from an integer (create_int_to_ptr)
    addressed: bool = False  # the kernel made an integer from a pointer (create_ptr_to_int)
    printed: bool = False  # the kernel printed (device_print): output a replay would not repeat
    reported: set[tuple[str, str]] = field(default_factory=set)  # (operation, argument) already in VIOLATIONS

    def bind(self, named: list[tuple[str, Any]]) -> None:
        ranges: dict[int, tuple[int, list[str]]] = {}
        for name, arg in named:
            for t in _tensors(arg):
                s = t.untyped_storage()
                ranges.setdefault(s.data_ptr(), (s.nbytes(), []))[1].append(name)
        order = sorted(ranges)
        self.starts = np.array(order, dtype=np.uint64)
        self.ends = np.array([p + ranges[p][0] for p in order], dtype=np.uint64)
        self.names = ["/".join(ranges[p][1]) for p in order]
        self.start_list, self.end_list = order, [p + ranges[p][0] for p in order]

    def check(self, op: str, ptrs: Any, mask: Optional[Any], program: Any) -> Optional[np.ndarray]:
        """None: every active lane is in bounds; else the mask of the lanes that are (the others are recorded)."""
        all_p = np.asarray(ptrs.data, dtype=np.uint64)  # the interpreter's pointers are uint64 and masks bool: no copy
        if mask is None:
            active = None
        else:
            active = np.asarray(mask.data, dtype=bool)
            if active.shape != all_p.shape:
                active = np.broadcast_to(active, all_p.shape)
        p = all_p if active is None else all_p[active]
        if not p.size:
            return None
        width = np.uint64(max(1, ptrs.get_element_ty().primitive_bitwidth // 8))
        # the common case, in a few scalar steps: the lowest and the highest address in one storage, hence all between
        lo, hi = int(_MIN(p)), int(_MAX(p))
        k = bisect.bisect_right(self.start_list, lo) - 1
        if k >= 0 and hi + int(width) <= self.end_list[k]:
            return None
        if active is None:
            active = np.ones(all_p.shape, dtype=bool)
        i = np.searchsorted(self.starts, p, side="right").astype(np.int64) - 1
        if self.ends.size:
            inside = (i >= 0) & (p + width <= self.ends[np.maximum(i, 0)])
        else:
            inside = np.zeros(p.shape, dtype=bool)
        if bool(inside.all()):
            return None
        if self.indirect:  # through a pointer table: inside some live tensor is in bounds
            inside[~inside] = _LIVE.holds(p[~inside], width)
            if bool(inside.all()):
                return None
        bad = p[~inside]
        first, k = int(bad[0]), int(i[~inside][0])
        if k >= 0:
            off = first - int(self.starts[k])
            arg, past = self.names[k], (f"at bytes [{off}, {off + int(width)}) of argument `{self.names[k]}`, whose storage holds "
                                        f"{int(self.ends[k] - self.starts[k])}")
        elif self.starts.size:
            arg, past = self.names[0], f"{int(self.starts[0]) - first} byte(s) before argument `{self.names[0]}`"
        else:
            arg, past = "", "and the launch has no tensor argument"
        message = (f"interpreted Triton kernel {self.kernel}, program {tuple(program)}: a masked {op} of {int(p.size)} element(s) "
                   f"reaches {bad.size} outside every tensor argument's storage, the first {past}")
        if mask is None:
            raise OutOfBoundsAccess(message + "; stopped before the access")
        if (op, arg) not in self.reported:  # once per operation and argument a launch
            self.reported.add((op, arg))
            VIOLATIONS.append(Violation(self.kernel, op, arg, message + "; masked off (on a GPU: an illegal memory access, or a "
                                        "silent write into whatever lies there)"))
        keep = active.copy()
        keep[active] = inside
        return keep


class _LiveStorages:
    """The storages of live tensors, by address: what a pointer loaded from memory may point into (a weak reference each:
    a storage freed since is not one a pointer may use).

    A pointer table holds addresses some code asked tensors for (`t.data_ptr()`, as vLLM builds its block-table pointers),
    so the tensors asked are noted as they are asked (note()) and looked at first; an address in none of them is looked
    for by one scan of every live object, which finds any tensor however its address was taken. The scan decides every
    address the noted tensors do not hold, so noting only saves scans: an address is held exactly when it lies in the
    storage of a tensor alive at the time of the access, either way."""

    _NOTED_MAX = 4096  # noted tensors before they are merged (the dead dropped): a process that never misses stays small

    def __init__(self) -> None:
        self._starts = np.zeros(0, dtype=np.uint64)
        self._ends = np.zeros(0, dtype=np.uint64)
        self._refs: list[weakref.ref] = []
        self._noted: dict[int, weakref.ref] = {}  # id(tensor) -> the tensor, asked for its address since the last merge

    def note(self, t: Any) -> None:
        try:
            ref = weakref.ref(t)
        except TypeError:  # an object without weak references: the scan finds what it holds
            return
        self._noted[id(t)] = ref
        if len(self._noted) > self._NOTED_MAX:
            self._merge()

    def holds(self, addrs: np.ndarray, width: np.uint64) -> np.ndarray:
        found = self._find(addrs, width)
        if not bool(found.all()) and self._noted:
            self._merge()
            found = self._find(addrs, width)
        if not bool(found.all()):
            self._scan()
            found = self._find(addrs, width)
        return found

    def _find(self, addrs: np.ndarray, width: np.uint64) -> np.ndarray:
        if not self._starts.size:
            return np.zeros(addrs.shape, dtype=bool)
        i = np.searchsorted(self._starts, addrs, side="right").astype(np.int64) - 1
        found = (i >= 0) & (addrs + width <= self._ends[np.maximum(i, 0)])
        for k in set(i[found].tolist()):  # the storage must still be the one seen there
            t = self._refs[k]()
            if t is None or t.untyped_storage().data_ptr() != int(self._starts[k]):
                found &= i != k
        return found

    def _merge(self) -> None:
        """The noted tensors' storages joined to those held (the dead of both dropped)."""
        noted, self._noted = self._noted, {}  # swapped first: a DP rank's thread may note while another merges
        seen = {a: (e, r) for a, e, r in zip(self._starts.tolist(), self._ends.tolist(), self._refs, strict=True) if r() is not None}
        for ref in noted.values():
            t = ref()
            if t is not None and t.device.type == "cpu":
                st = t.untyped_storage()
                seen[st.data_ptr()] = (st.data_ptr() + st.nbytes(), ref)  # the newest tensor at an address: the one alive there
        self._hold(seen)

    def _scan(self) -> None:
        # gc.get_objects() leaves out what a gc.freeze() moved to the permanent generation (a test process freezes its
        # heap after collection; a tensor made before then may be what a pointer names): thaw it, for good
        if gc.get_freeze_count():
            gc.unfreeze()
        seen: dict[int, tuple[int, weakref.ref]] = {}
        for o in gc.get_objects():
            if issubclass(type(o), torch.Tensor) and o.device.type == "cpu":  # type(): no proxy's __class__ is asked
                st = o.untyped_storage()
                seen.setdefault(st.data_ptr(), (st.data_ptr() + st.nbytes(), weakref.ref(o)))
        self._hold(seen)

    def _hold(self, seen: dict[int, tuple[int, weakref.ref]]) -> None:
        order = sorted(seen)
        self._starts = np.array(order, dtype=np.uint64)
        self._ends = np.array([seen[a][0] for a in order], dtype=np.uint64)
        self._refs = [seen[a][1] for a in order]


_LIVE = _LiveStorages()
MEMO = LaunchMemo()  # every memoizable launch of the process (launch_memo.py)


class _Current(threading.local):
    launches: list[_Launch]

    def __init__(self) -> None:
        self.launches = []


_CURRENT = _Current()


def _tensors(arg: Any) -> list[Any]:
    if isinstance(arg, (tuple, list)):
        return [t for a in arg for t in _tensors(a)]
    if hasattr(arg, "base") and hasattr(arg, "block_shape"):  # a TensorDescriptor: its base tensor
        return _tensors(arg.base)
    return [arg] if hasattr(arg, "data_ptr") and hasattr(arg, "untyped_storage") else []


def prepare_interpreter() -> None:
    patch_interpreter_index()
    speed_up_interpreter()
    guard_interpreter_memory()


def patch_interpreter_index() -> None:
    """Triton's interpreter turns a scalar argument into int() of a 1-element array, which numpy 2
    refuses (a loop bound loaded from memory: `range(0, n, BLOCK)` in vLLM's input-prep kernels and in
    SGLang's rotate_input_ids): take the element instead. Idempotent."""
    interp = importlib.import_module("triton.runtime.interpreter")
    original = interp._patch_lang_tensor

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]) if self.handle.data.size == 1
                       else int(self.handle.data))

    if getattr(original, "__name__", "") != "patch_lang_tensor":
        interp._patch_lang_tensor = patch_lang_tensor


# (builder method, position of the pointer argument, position of the mask argument or None), positions after self
_MEMORY_OPS = (("create_masked_load", 0, 1, "load"), ("create_masked_store", 0, 2, "store"),
               ("create_atomic_rmw", 1, 3, "atomic"), ("create_atomic_cas", 0, None, "atomic compare-and-swap"))


def guard_interpreter_memory() -> None:
    """Check every interpreted memory access against its launch's tensor arguments (the module docstring). Idempotent."""
    interp = importlib.import_module("triton.runtime.interpreter")
    executor, builder = interp.GridExecutor, interp.InterpreterBuilder
    if getattr(executor.__call__, "__specharness_guard__", False):
        return
    launch_call, init_args = executor.__call__, executor._init_args_hst

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        key, storages = _memo_key(self, args, kwargs, interp.interpreter_builder.options)
        shared = None
        if key is not None:
            if MEMO.replay(key, storages):
                return None
            shared = _shared_file(self, key)  # named only now: a digest of every byte the launch can read
            if shared is not None and MEMO.replay(key, storages, shared):
                return None
        launch = _Launch(getattr(self.fn, "__name__", str(self.fn)))
        _CURRENT.launches.append(launch)
        try:
            ret = launch_call(self, *args, **kwargs)
        finally:
            _CURRENT.launches.pop()
        if key is not None and ret is None and not (launch.indirect or launch.addressed or launch.printed or launch.reported):
            MEMO.record(key, storages, shared)
        return ret

    def init_args_hst(self: Any, args_dev: Any, kwargs: Any) -> Any:
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        if _CURRENT.launches:
            _CURRENT.launches[-1].bind([*zip(self.arg_names, args_hst, strict=False), *kwargs_hst.items()])
        return args_hst, kwargs_hst

    call.__specharness_guard__ = True  # type: ignore[attr-defined]
    executor.__call__, executor._init_args_hst = call, init_args_hst
    tensor_data_ptr = torch.Tensor.data_ptr

    def data_ptr(self: torch.Tensor) -> int:
        address = tensor_data_ptr(self)
        _LIVE.note(self)  # an address handed out may be stored in a pointer table a kernel loads from (_LiveStorages)
        return address

    torch.Tensor.data_ptr = data_ptr  # type: ignore[method-assign]
    for method, ptr_at, mask_at, op in _MEMORY_OPS:
        setattr(builder, method, _guarded_op(getattr(builder, method), ptr_at, mask_at, op))
    builder.create_int_to_ptr = _flagging(builder.create_int_to_ptr, "indirect")
    builder.create_ptr_to_int = _flagging(builder.create_ptr_to_int, "addressed")
    builder.create_print = _flagging(builder.create_print, "printed")


def _flagging(original: Any, flag: str) -> Any:
    """The builder method, setting `flag` on the launch under way when the kernel uses it."""
    def flagged(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _CURRENT.launches:
            setattr(_CURRENT.launches[-1], flag, True)
        return original(self, *args, **kwargs)

    return flagged


def _memo_key(executor: Any, args: tuple, kwargs: dict, options: Any) -> tuple[Optional[Hashable], list[torch.UntypedStorage]]:
    """The launch's key in MEMO, or None where the key could not hold all it depends on: a grid computed by a function
    (it may read anything) or a pre-run hook (it may do anything). The kernel's code is its function (a Triton kernel
    reads no mutable global: the language has only constexpr globals); the options (debug among them) steer the
    semantic layer."""
    grid = executor.grid
    if executor.pre_run_hooks or not isinstance(grid, (tuple, list)) or not all(type(g) is int for g in grid):
        return None, []
    return MEMO.key((executor.fn, tuple(grid), repr(options)), args, kwargs)


def _shared_file(executor: Any, key: Hashable) -> Optional[Path]:
    """Where processes sharing a launch memo keep this launch's effect (launch_memo.py), or None: no shared folder, or
    a kernel with no identity across processes (shared_memo.py)."""
    folder = shared_folder()
    if folder is None:
        return None
    identity = kernel_identity(executor.fn)
    if identity is None:
        return None
    _, grid, options = key[0]
    return MEMO.shared_file(folder, f"{identity} {grid} {options}", key)


def _guarded_op(original: Any, ptr_at: int, mask_at: Optional[int], op: str) -> Any:
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _CURRENT.launches:  # the interpreter's semantic layer passes them positionally
            mask = None if mask_at is None else args[mask_at]
            keep = _CURRENT.launches[-1].check(op, args[ptr_at], mask, self.grid_idx)
            if keep is not None:  # the out-of-bounds lanes masked off (recorded in VIOLATIONS)
                args = (*args[:mask_at], type(mask)(keep, mask.dtype), *args[mask_at + 1:])
        return original(self, *args, **kwargs)

    return guarded
