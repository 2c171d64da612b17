"""A launch's effect, written back on an exactly equal state instead of computed again.

Triton's interpreter runs a launch program by program in Python (milliseconds each), and engine-check
launches the same kernels on the same inputs many times: the DP ranks of a world replay one schedule,
and the decode paths share their prefill. A launch is a deterministic function of what it can read,
and its only effect is writes into the memory it can address. Where all of that is in the key -- the
bytes of every storage its tensor arguments view (compared whole, not hashed), each tensor's dtype,
shape, strides, storage offset and which arguments share a storage, the plain scalar arguments, and
the caller's context (which kernel, grid and options) -- an equal key means an equal effect, and
writing back every byte of those storages as the first launch left them is exact, not an
approximation. What the key cannot see is the caller's to leave out (`record` is never called for it):
interpreter.py never memoizes a launch that made a pointer from an integer (it read memory no argument
names) or an integer from a pointer (its result may depend on where the heap put the arguments), one
that printed (output is an effect too), nor one that raised or had an access masked off.

Processes may share what they memoize: with $SPECHARNESS_LAUNCH_MEMO_DIR set to a folder, each effect kept is also
written there, in a file named by a digest of its whole key, and a launch not seen in this process looks for its file
before it runs. The function object that keys a launch in-process is then named by what its code can depend on
(shared_memo.py), so a planted copy's edited kernel never meets its release's effects. The test suite sets the
folder for each run: an engine release and its planted copies, checked in processes of their own, interpret the
launches they share once.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable, Optional

import torch

from harness.engines.shared_memo import SHARED_MEMO_ENV

_SCALARS = (int, bool, str, type(None))


def storage_bytes(storage: torch.UntypedStorage) -> bytes:
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes()


def write_storage(storage: torch.UntypedStorage, data: bytes) -> None:
    """Put back bytes storage_bytes() read from a storage of the same size."""
    storage.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8).untyped_storage())


def launch_state(args: tuple, kwargs: dict) -> tuple[Optional[Hashable], list[torch.UntypedStorage]]:
    """(the key of a call's inputs, the storages its tensor arguments view, in first-seen order); key None: an argument
    of a kind the key cannot hold (not a CPU tensor, a float or a plain scalar), so the call is not memoizable."""
    storages: dict[int, torch.UntypedStorage] = {}
    parts: list[Hashable] = []
    for name, v in [*enumerate(args), *sorted(kwargs.items())]:
        if isinstance(v, torch.Tensor):
            if v.device.type != "cpu":
                return None, []
            s = v.untyped_storage()
            index = list(storages).index(s.data_ptr()) if s.data_ptr() in storages else len(storages)
            storages.setdefault(s.data_ptr(), s)
            parts.append((name, "tensor", v.dtype, tuple(v.shape), v.stride(), v.storage_offset(), index))
        elif isinstance(v, float):  # by its bits: -0.0 is not 0.0, a NaN equals itself
            parts.append((name, "float", struct.pack("<d", v)))
        elif isinstance(v, _SCALARS):
            parts.append((name, type(v).__name__, v))
        else:
            return None, []
    return (tuple(parts), tuple(storage_bytes(s) for s in storages.values())), list(storages.values())


@dataclass
class LaunchMemo:
    """Per key, the bytes each storage held after the first launch (None: the launch left it as it was)."""

    max_bytes: int = 256 << 20  # held in all before new launches are no longer kept (the memo must not crowd the check out)
    effects: dict[Hashable, tuple[Optional[bytes], ...]] = field(default_factory=dict)
    held: int = 0
    hits: int = 0
    shared_hits: int = 0  # of the hits, those read from a shared folder

    def key(self, context: Hashable, args: tuple, kwargs: dict) -> tuple[Optional[Hashable], list[torch.UntypedStorage]]:
        state, storages = launch_state(args, kwargs)
        return (None, []) if state is None else ((context, state), storages)

    def replay(self, key: Hashable, storages: list[torch.UntypedStorage], shared: Optional[Path] = None) -> bool:
        """Write back the effect of the launch first seen at `key` (True), or do nothing (False: not seen). `shared`: the
        file another process keeps that effect in (shared_file), read where this process has not seen the key."""
        after = self.effects.get(key)
        if after is None and shared is not None and shared.is_file():
            after = _read_effect(shared, len(storages))
            self.shared_hits += 1
            self._keep(key, after)
        if after is None:
            return False
        for s, b in zip(storages, after, strict=True):
            if b is not None:
                write_storage(s, b)
        self.hits += 1
        return True

    def record(self, key: Hashable, storages: list[torch.UntypedStorage], shared: Optional[Path] = None) -> None:
        """Keep what the launch just made at `key` left in its storages; `shared`: in that file too, for other processes."""
        after = tuple(None if a == b else a for a, b in zip((storage_bytes(s) for s in storages), key[1][1], strict=True))
        if self._keep(key, after) and shared is not None:
            _write_effect(shared, after)

    def _keep(self, key: Hashable, after: tuple[Optional[bytes], ...]) -> bool:
        size = sum(map(len, key[1][1])) + sum(len(a) for a in after if a is not None)
        if self.held + size > self.max_bytes:
            return False
        self.effects[key] = after
        self.held += size
        return True

    @staticmethod
    def shared_file(folder: Path, context: str, key: Hashable) -> Path:
        """The file of `key`'s effect in a shared folder: a digest of the context's text (what names the kernel across
        processes, its grid and options) and of the key's input state, every byte of every storage included."""
        parts, data = key[1]
        digest = hashlib.sha256(f"{context}\n{parts!r}".encode())
        for b in data:
            digest.update(len(b).to_bytes(8, "little"))
            digest.update(b)
        return folder / f"{digest.hexdigest()}.effect"


def _write_effect(path: Path, after: tuple[Optional[bytes], ...]) -> None:
    """Written whole under another name, then renamed: a reader sees the file complete or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(pickle.dumps(after, protocol=pickle.HIGHEST_PROTOCOL))
    os.replace(tmp, path)


def _read_effect(path: Path, storages: int) -> tuple[Optional[bytes], ...]:
    what = f"{path}: not a launch effect of {storages} storage(s) (${SHARED_MEMO_ENV} must hold only what launch_memo.py wrote)"
    try:
        after = pickle.loads(path.read_bytes())
    except Exception as err:  # any unpickling failure: the file is not ours
        raise RuntimeError(what) from err
    if not (isinstance(after, tuple) and len(after) == storages and all(a is None or isinstance(a, bytes) for a in after)):
        raise RuntimeError(what)
    return after
