"""The process's one fork server, shared by everything that forks from it with torch already imported.

Spawning a rank costs a fresh interpreter importing torch (seconds per rank on a small machine,
paid by every rank of every launch). The standard library's forkserver imports a list of modules
once, in a server process that never runs a torch op (so no thread pool is forked), and forks
each child from it. There is one such server per process, with one preload list and the
environment it was started with: callers register what they need before the first start, and
the first start takes the union. A child's own environment is its parent's, sent along and
installed by the child (a forked child would otherwise inherit the server's).
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
from typing import Mapping, Sequence

from harness.ranks.environ import patched_environ

_preload: list[str] = []
_start_env: dict[str, str] = {}


def register(preload: Sequence[str], start_env: Mapping[str, str] | None = None) -> None:
    """Ask for modules in the server (and variables in its environment while it starts); no effect once it runs."""
    _preload.extend(m for m in preload if m not in _preload)
    _start_env.update(start_env or {})
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(_preload))


def context(preload: Sequence[str] = ()) -> multiprocessing.context.ForkServerContext:
    """The forkserver context, its server running with every registered module imported."""
    register(preload)
    with patched_environ(_start_env):
        multiprocessing.forkserver.ensure_running()
    return multiprocessing.get_context("forkserver")
