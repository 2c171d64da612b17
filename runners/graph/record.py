"""The CPU graph: record the ops a step body launches at capture, replay the record (docs/architecture.md, the graph mechanism).

A CUDA graph replays kernels, not Python: every host value the body computed during
capture (an int read from an attribute, a branch taken, a shape) is frozen into the
recorded kernels, and a host read of device data cannot be captured at all. Re-running
the body's Python at replay would hide both. So the CPU graph captures by running the
body once under a dispatcher-level recorder (a TorchDispatchMode, thread-local, so each
simulated rank records its own graph) and replays the list of ops it saw; no Python
frame of the body runs at replay.

What an op refers to is kept by identity, as a CUDA graph keeps device addresses:
tensors that existed before capture (static buffers, weights, KV pools) are the same
objects at every replay, so a replay reads their current contents; tensors made during
capture are the graph's private pool. A replay writes every op's result into the
tensor capture produced: an out-of-place op is computed and copied in, an in-place or
out= op runs on the captured tensors, and a view is not re-run at all (a view made at
capture aliases its base for good, a static buffer or a pool tensor). The body's
outputs are therefore overwritten in place by each replay, and a consumer holding a
view of one sees it change, as on a GPU. Non-tensor arguments (ints, shapes, dtypes)
are the values the dispatcher received at capture.

Everything the body launches must reach the dispatcher to be recorded: aten ops do;
the collectives (runners.parallel.comm) and the Triton launches are torch custom ops
for that reason.

Capture-time guards: an op that returns device data to the host or whose output shape
depends on device data (`.item()`, `int(t)`, `bool(t)`, `nonzero`, `unique`, boolean
mask indexing), and the Tensor methods that read device data without a dispatcher op
on CPU (`.tolist()`, `.numpy()`, `.cpu()`), raise GraphCaptureError naming the op and
the body's file:line, where a CUDA capture fails. Inside a recorded op (a collective's
own bookkeeping, the Triton interpreter) host reads are the op's business and allowed.

Host mirrors (runners.graph.host): an op whose tensors are all host tensors runs on the
host at capture and is not recorded, as a GPU capture leaves it out; its results are host
tensors too, and reading them (`.item()`, `.tolist()`) is a host read, allowed. A device
op may take a 0-dim host tensor, as a CUDA kernel takes a CPU scalar: its value at capture
is baked into the record. Any other mix of host and device tensors in one op (a copy
between them, a host index, a host tensor written by a device op) is a host-device copy
a CUDA capture refuses, and so does this one.
"""
from __future__ import annotations

import functools
import linecache
import os
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from runners.graph.host import host_device_mix, host_mirror, host_mirrors, is_host_mirror
from runners.graph.pool import RecordedPool


class GraphCaptureError(RuntimeError):
    """The body did something a CUDA graph capture refuses (a host read of device data)."""


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_GRAPH_FILES = {os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)), "backend.py")}
_HOST_READ_METHODS = ("tolist", "numpy", "cpu")  # device-to-host reads that dispatch no op on a CPU tensor
_MASK_DTYPES = (torch.bool, torch.uint8)


def _body_site() -> str:
    """file:line of the innermost frame outside torch and the graph machinery: the body's line."""
    f = sys._getframe(1)
    while f is not None:
        name = os.path.abspath(f.f_code.co_filename)
        if not name.startswith(_TORCH_DIR) and name not in _GRAPH_FILES:
            code = linecache.getline(f.f_code.co_filename, f.f_lineno).strip()
            try:
                shown = os.path.relpath(name)
            except ValueError:  # another drive (Windows)
                shown = name
            return f"{shown}:{f.f_lineno} in {f.f_code.co_name}" + (f": {code}" if code else "")
        f = f.f_back
    return "<no frame outside torch>"


def _refuse(what: str) -> GraphCaptureError:
    return GraphCaptureError(
        f"graph capture: {what} needs device data on the host, which a CUDA graph cannot capture "
        f"(at {_body_site()}); keep host values in the ForwardBatch's host metadata or compute on the device"
    )


_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
_INDEX = torch.ops.aten.index.Tensor
_INDEX_PUTS = (torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default, torch.ops.aten._index_put_impl_.default)


def _has_mask(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES for i in indices or ())


_OK, _REFUSED, _MASKABLE_READ, _MASKABLE_WRITE = range(4)


def _capturability(func: torch._ops.OpOverload) -> int:
    if func is _INDEX:
        return _MASKABLE_READ
    if func in _INDEX_PUTS:
        return _MASKABLE_WRITE
    if func is _LOCAL_SCALAR or torch.Tag.data_dependent_output in func.tags or torch.Tag.dynamic_output_shape in func.tags:
        return _REFUSED
    return _OK


def _check_capturable(func: torch._ops.OpOverload, args: tuple, kind: int) -> None:
    """Refuse what a CUDA capture refuses: host reads and data-dependent output shapes.

    aten.index.Tensor carries the dynamic-shape tag for every index, but only a boolean
    mask makes its shape depend on the data (an integer gather is static); a masked
    index_put with a single value is a masked fill (no sync), with several it is not.
    """
    if kind == _REFUSED:
        what = "(.item(), int(t), float(t), bool(t))" if func is _LOCAL_SCALAR else "(data-dependent output)"
        raise _refuse(f"{func} {what}")
    if _has_mask(args[1]) and (kind == _MASKABLE_READ or args[2].numel() != 1):
        raise _refuse(f"{func} with a boolean mask (data-dependent shape)")


# ---- Tensor methods that read device data without a dispatcher op (on CPU) ----

_state = threading.local()  # .capturing: this thread runs a body under capture (and not inside a recorded op)
_guard_lock = threading.Lock()
_guard_holders = 0
_originals: dict[str, Callable] = {}


def _capturing() -> bool:
    return getattr(_state, "capturing", False)


def recording() -> bool:
    """True while this thread runs a body under a recording capture: the CPU graph's
    torch.cuda.is_current_stream_capturing(), for code that plans on the host outside capture."""
    return _capturing()


def _guarded(name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        if _capturing() and not is_host_mirror(self):
            raise _refuse(f"Tensor.{name}()")
        return original(self, *args, **kwargs)

    return method


@contextmanager
def _host_read_guard() -> Iterator[None]:
    """Guard the host-read methods while any thread captures; the guard passes other threads through.

    Process-wide (the methods are torch.Tensor's) and re-entrant across threads, as
    no_gc_during_capture is: installed by the first capture, removed after the last.
    """
    global _guard_holders
    with _guard_lock:
        if _guard_holders == 0:
            for name in _HOST_READ_METHODS:
                _originals[name] = getattr(torch.Tensor, name)
                setattr(torch.Tensor, name, _guarded(name, _originals[name]))
        _guard_holders += 1
    try:
        yield
    finally:
        with _guard_lock:
            _guard_holders -= 1
            if _guard_holders == 0:
                for name, original in _originals.items():
                    setattr(torch.Tensor, name, original)
                _originals.clear()


@contextmanager
def _capturing_as(value: bool) -> Iterator[None]:
    saved = _capturing()
    _state.capturing = value
    try:
        yield
    finally:
        _state.capturing = saved


# ---- the record ----


class RecordedOp(NamedTuple):
    """One dispatcher call as capture saw it, and how a replay leaves its result in the captured tensors.

    Out-of-place ops with an out= overload are recorded as that overload writing straight
    into their captured outputs; the others are computed and copied in, `refresh` pairing
    result positions with the captured tensors they overwrite.
    """

    func: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    refresh: tuple[tuple[int, torch.Tensor], ...] = ()

    def __str__(self) -> str:
        return str(self.func)


_MUTATES, _VIEW, _FUNCTIONAL = range(3)
_UNANNOTATED_VIEWS = (torch.ops.aten._unsafe_view.default,)  # aliases its input without saying so in its schema


def _effect(func: torch._ops.OpOverload) -> int:
    schema = func._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return _MUTATES  # in-place, out= and mutating custom ops: re-run on the captured tensors
    if func in _UNANNOTATED_VIEWS or (schema.returns and all(r.alias_info is not None for r in schema.returns)):
        return _VIEW
    return _FUNCTIONAL


def _signature(schema: torch._C.FunctionSchema) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in schema.arguments if not a.is_out]


def _out_overload(func: torch._ops.OpOverload) -> Optional[tuple[torch._ops.OpOverload, tuple[str, ...]]]:
    """The out= overload of a functional op with the same arguments, and its out argument names."""
    want = _signature(func._schema)
    packet = func.overloadpacket
    for name in packet.overloads():
        cand = getattr(packet, name)
        outs = tuple(a.name for a in cand._schema.arguments if a.is_out)
        if outs and len(outs) == len(func._schema.returns) and _signature(cand._schema) == want:
            return cand, outs
    return None


class _Plan(NamedTuple):
    """What the recorder does with one op, decided once per op."""

    func: torch._ops.OpOverload  # held, so the id keying the plan stays this op's
    capturability: int
    effect: int
    out: Optional[tuple[torch._ops.OpOverload, tuple[str, ...]]]
    call: Callable  # the C++ op OpOverload.__call__ forwards to (a Python frame fewer per op)


_PLANS: dict[int, _Plan] = {}  # by id(func): an OpOverload's own hash is Python code, run per op otherwise


def _plan(func: torch._ops.OpOverload) -> _Plan:
    plan = _PLANS.get(id(func))
    if plan is None:
        effect = _effect(func)
        plan = _PLANS[id(func)] = _Plan(func, _capturability(func), effect, _out_overload(func) if effect == _FUNCTIONAL else None,
                                        _op_call(func))
    return plan


def _op_call(func: torch._ops.OpOverload) -> Callable:
    """OpOverload.__call__ only forwards to the C++ op: call that directly (replay does, for every recorded op)."""
    return getattr(func, "_op", func)


def _record(plan: _Plan, args: tuple, kwargs: dict, out: Any) -> Optional[RecordedOp]:
    """The op to replay, or None for a view (its captured output aliases its base for good)."""
    if plan.effect == _VIEW:
        return None
    if plan.effect == _MUTATES:
        return RecordedOp(plan.func, args, kwargs)
    if isinstance(out, torch.Tensor):  # the common case, one output
        if not out.numel():
            return None
        if plan.out is not None and len(plan.out[1]) == 1:
            return RecordedOp(plan.out[0], args, {**kwargs, plan.out[1][0]: out})
        return RecordedOp(plan.func, args, kwargs, ((0, out),))
    leaves = tree_leaves(out)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    if not any(t.numel() for t in tensors):
        return None  # no data to refresh (a metadata query, an empty result)
    if plan.out is not None and len(tensors) == len(leaves) == len(plan.out[1]):
        return RecordedOp(plan.out[0], args, {**kwargs, **dict(zip(plan.out[1], leaves, strict=True))})
    return RecordedOp(plan.func, args, kwargs, tuple((i, t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.numel()))


def _tensors_in(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors of an op's arguments (as such or in Tensor[] lists), in tree_leaves order, without pytree's per-node
    type lookup: run on every op a capture records, pytree was most of what recording cost. An aten argument is a
    tensor, a scalar or a flat list; the first level is walked inline, anything deeper by `_nested`."""
    out: list[torch.Tensor] = []
    for x in args:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple, dict)):
            _nested(x, out)
    if kwargs:
        for x in kwargs.values():
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, (list, tuple, dict)):
                _nested(x, out)
    return out


def _nested(x: Any, out: list[torch.Tensor]) -> None:
    for y in (x.values() if isinstance(x, dict) else x):
        if isinstance(y, torch.Tensor):
            out.append(y)
        elif isinstance(y, (list, tuple, dict)):
            _nested(y, out)


class _Recorder(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no torch.compile inside a capture: spare every op the disable-dynamo wrapper

    def __init__(self, pool: Optional[RecordedPool]) -> None:
        super().__init__()
        self.ops: list[RecordedOp] = []
        self.views = 0
        self.pool = pool
        self.made: list[torch.Tensor] = []  # the new tensors of the capture (its functional ops' results)
        self.host_ops = 0  # ops on host tensors: run at capture, not recorded

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        plan = _PLANS.get(id(func)) or _plan(func)
        tensors = _tensors_in(args, kwargs)
        host = host_mirrors(tensors)
        if host and len(host) == len(tensors):
            return self._host_op(func, args, kwargs)
        if host:
            problem = host_device_mix(func, args, kwargs, host)
            if problem is not None:
                raise GraphCaptureError(f"graph capture: {problem}, which a CUDA graph capture refuses (at {_body_site()}); "
                                        "copy host values into the static buffers before the replay")
            args, kwargs = tree_map_only(torch.Tensor, lambda t: t.clone() if is_host_mirror(t) else t, (args, kwargs))  # baked
        if plan.capturability != _OK:
            _check_capturable(func, args, plan.capturability)
        _state.capturing = False  # the op's own implementation may read the host (collective bookkeeping, interpreter)
        try:
            out = plan.call(*args, **kwargs)
        finally:
            _state.capturing = True
        if plan.effect == _FUNCTIONAL and self.pool is not None:
            out = self.pool.place(out) if isinstance(out, torch.Tensor) else tree_map_only(torch.Tensor, self.pool.place, out)
            self.made.extend(_tensors_in((out,), {}))
        op = _record(plan, args, kwargs, out)
        if op is None:
            self.views += 1
        else:
            self.ops.append(op)
        return out

    def _host_op(self, func, args: tuple, kwargs: dict) -> Any:
        """Runs now and never again: a GPU capture does not see host work. Its results are host tensors."""
        _state.capturing = False
        try:
            out = func(*args, **kwargs)
        finally:
            _state.capturing = True
        self.host_ops += 1
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                host_mirror(t)
        return out


class RecordedGraph:
    """The CPU graph: `capture` runs the body once under the recorder, `replay` re-issues the recorded ops.

    The body is dropped after capture: a replay has no Python of the body to run. With a pool
    (runners.graph.pool), the tensors a capture makes may sit in memory earlier captures of the
    pool freed, as in a CUDA graph pool.
    """

    kind = "sim"

    def __init__(self, body: Callable[[], Any], pool: Optional[RecordedPool] = None):
        self._body: Optional[Callable[[], Any]] = body
        self.pool = pool
        self.output: Any = None
        self.ops: list[RecordedOp] = []
        self.num_views = 0  # view ops seen at capture, not re-run (their outputs alias their bases)
        self.num_host_ops = 0  # ops on host mirrors, run at capture only (runners.graph.host)
        self._calls: list[tuple[Callable, tuple, dict, tuple]] = []

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    def capture(self) -> Any:
        if self._body is None:
            raise RuntimeError("this graph was captured already")
        recorder = _Recorder(self.pool)
        with _host_read_guard(), _capturing_as(True), recorder:
            self.output = self._body()
        if self.pool is not None:
            self.pool.release(recorder.made, self.output)
        self.ops, self.num_views, self.num_host_ops, self._body = recorder.ops, recorder.views, recorder.host_ops, None
        self._calls = [(_op_call(op.func), op.args, op.kwargs, op.refresh) for op in self.ops]
        return self.output

    def replay(self) -> None:
        self._replay_ops(0, len(self._calls))

    def _replay_ops(self, start: int, stop: int) -> None:
        """Re-issue recorded ops [start, stop) (a PIECEWISE graph replays its pieces apart: runners.graph.piecewise)."""
        for call, args, kwargs, refresh in self._calls[start:stop]:
            out = call(*args, **kwargs)
            if refresh:
                leaves = (out,) if isinstance(out, torch.Tensor) else tree_leaves(out)
                for i, dst in refresh:
                    dst.copy_(leaves[i])

    def op_counts(self) -> dict[str, int]:
        """Recorded ops by name, for reports."""
        counts: dict[str, int] = {}
        for op in self.ops:
            counts[str(op)] = counts.get(str(op), 0) + 1
        return counts
