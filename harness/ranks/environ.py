"""os.environ patched while a child process starts, then restored: what a spawned interpreter or a freshly started
forkserver inherits is the environment at that moment. One lock for the process, since os.environ is shared by
every thread that may be starting a child."""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterator, Mapping

_lock = threading.Lock()


@contextmanager
def patched_environ(env: Mapping[str, str]) -> Iterator[None]:
    with _lock:
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
