"""prepare()'s replay fill: the engine's Triton kernel (GPU path) and its native twin (NPU path), both checked.

From the releases whose composite has prepare(), the multi-layer replay fill is one fused
Triton kernel (fill_draft_extend_prepare_buffers_triton); later releases also ship a
PyTorch twin (..._native) that the module selects on NPUs. They differ: the kernel also
zeroes the token tail and resets seq_lens past bs. A bug in either is a bug on some device,
so neither may stand in for the other:

* the Triton kernel runs as the engine calls it, under Triton's interpreter
  (TRITON_INTERPRET=1, set by the loader before anything is jitted): the kernel's own code
  runs on CPU tensors, program by program;
* the native twin runs on clones of the same buffers, with the same arguments, just before
  the kernel; its result is kept and checked as a second path of the same replay.

The interpreter runs the kernel program by program (~10 ms each, max_bs + 2 programs a
launch), so `kernel` says per (layout, rank) whether the kernel runs: where it does not,
the native twin fills the real buffers (the NPU path, checked directly), and a release with
no native twin runs the kernel everywhere.

The interpreted kernel is also memoized (FillMemo): engine-check launches it many times on
identical inputs (every DP rank of a layout replays the same schedule), and each launch
costs the interpreter's full run. A repeated launch replays the first one's effect instead,
which is exact, not an approximation: the launcher and its kernel are deterministic
functions of their arguments (tensor contents, dtypes, shapes, strides, storage offsets,
which arguments share storage, and the plain scalars) whose only effects are writes into
the memory of their tensor arguments and a None return. The key holds all of that, every
byte of every storage the arguments view included (compared whole, not hashed), and a hit
writes back every byte of those storages as the first launch left them, and reports again
the out-of-bounds accesses the first launch had masked off (interpreter.VIOLATIONS): the bug
is in every launch, not only the one that ran. A call with an argument of any other kind, or
one that returns something, is run, never memoized.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Optional

import torch

from harness.engines.interpreter import VIOLATIONS, Violation
from harness.engines.launch_memo import launch_state, storage_bytes, write_storage

# The per-request and per-token buffers the fill writes, as the fill's parameters name them.
FILLED = ("input_ids", "positions", "out_cache_loc", "seq_lens", "req_pool_indices", "num_correct_drafts",
          "num_accept_tokens", "select_index", "global_num_tokens", "global_num_tokens_for_logprob")


@dataclass
class FillObserver:
    """Stands where prepare() looks up its fill: calls the native twin on clones, then the engine's fill."""

    engine_fill: Callable
    native: Optional[Callable]
    kernel: bool = True  # run the engine's kernel; False: the native twin alone
    beside: bool = True  # where the kernel runs, also run the native twin beside it on clones (paths.FillPlan)
    last_native: Optional[dict[str, Optional[list[int]]]] = None
    calls: int = field(default=0)
    kernel_calls: int = field(default=0)
    memo: "FillMemo" = field(default_factory=lambda: FillMemo())

    def __post_init__(self) -> None:
        self._sig = inspect.signature(self.native) if self.native is not None else None

    @contextlib.contextmanager
    def kernel_alone(self) -> Iterator[None]:
        """The one-graph composite's prepare(): the worker builds it only off NPU (`if not _is_npu`), where prepare() fills
        with the kernel, so neither the twin nor a check of the twin's lanes belongs to it."""
        saved = self.kernel, self.native, self._sig
        self.kernel, self.native, self._sig = True, None, None
        try:
            yield
        finally:
            self.kernel, self.native, self._sig = saved

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.last_native = None
        if not self.kernel and self.native is not None:
            return self.native(*args, **kwargs)
        self.kernel_calls += 1
        if self._sig is not None and self.beside:
            bound = self._sig.bind(*args, **kwargs)
            clones = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in bound.arguments.items()}
            self.native(**clones)
            self.last_native = {k: (None if clones.get(k) is None else [int(x) for x in clones[k].reshape(-1).tolist()]) for k in FILLED}
        return self.memo.call(self.engine_fill, args, kwargs)


@dataclass
class FillMemo:
    """A deterministic launcher's effect per exact input state (the module docstring says why replaying it is exact)."""

    effects: dict[Hashable, tuple[list[bytes], list[Violation]]] = field(default_factory=dict)
    hits: int = 0

    def call(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        key, storages = launch_state(args, kwargs)
        seen = None if key is None else self.effects.get(key)
        if seen is not None:
            after, violations = seen
            for s, b in zip(storages, after, strict=True):
                write_storage(s, b)
            VIOLATIONS.extend(violations)
            self.hits += 1
            return None
        mark = len(VIOLATIONS)
        ret = fn(*args, **kwargs)
        if key is not None and ret is None:
            self.effects[key] = ([storage_bytes(s) for s in storages], VIOLATIONS[mark:])
        return ret


# The function the worker (and, 0.5.16 on, the one graph) advances the draft chain with between multi-layer steps,
# as 0.5.16 on / 0.5.15 name it.
WORKER_ROTATE = ("rotate_input_ids", "rotate_input_ids_triton")


@dataclass
class InPlaceLauncher:
    """A launcher that writes into its tensor arguments and hands back its first one (the draft chain's
    rotate_input_ids): memoized as FillMemo is (the module docstring), where it did hand back its first argument."""

    fn: Callable
    memo: FillMemo = field(default_factory=FillMemo)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        def launch(*a: Any, **k: Any) -> Optional[tuple]:
            ret = self.fn(*a, **k)
            return None if a and ret is a[0] else (ret,)

        ret = self.memo.call(launch, args, kwargs)
        return args[0] if ret is None else ret[0]


def fill_name(ml: Any) -> Optional[str]:
    """The module global prepare() calls for the fill (the name moved once), or None: a Python fill."""
    for name in ("fill_draft_extend_prepare_buffers", "fill_draft_extend_prepare_buffers_triton"):
        if hasattr(ml, name):
            return name
    return None
