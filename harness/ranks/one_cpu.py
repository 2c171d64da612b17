"""Rank threads that take turns under the GIL run on one CPU.

Simulated ranks (and an engine check's DP-rank threads) hand the interpreter to each other at every collective: only
one of them runs at a time whatever the machine has. Spread over two or more CPUs, each hand-off wakes a thread on
another CPU, which finds the GIL taken and sleeps again; in a world of 16 or 32 ranks that ping-pong, most of it in
the kernel, costs more than the ranks' own work. On one CPU the ranks still interleave at the same collectives, so
the results are the same.

Linux sets a thread's affinity per thread, and a new thread inherits its creator's: the threads started inside
`threads_on_one_cpu()` stay on the CPU the caller was running on (where /proc does not say which, one picked by the
process id, so that two processes' worlds do not default to the same CPU), while the caller and every other thread of
the process keep their own affinity. Where the OS has no per-thread affinity call (os.sched_setaffinity is
Linux-only) or the process may run on one CPU only, the block changes nothing: there is no other CPU to ping-pong
with on the latter, and the former is a platform this module cannot steer.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

# /proc/<pid>/task/<tid>/stat: the 39th field is the CPU the thread last ran on; fields are counted after the command
# name's closing parenthesis (the name itself may hold spaces), which ends field 2
_CPU_FIELD_AFTER_NAME = 39 - 3


def current_cpu() -> Optional[int]:
    """The CPU this thread last ran on (Linux); None where /proc does not say (a sandbox without it)."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[_CPU_FIELD_AFTER_NAME])
    except (OSError, IndexError, ValueError):
        return None


@contextlib.contextmanager
def threads_on_one_cpu() -> Iterator[None]:
    """Threads started inside the block run on one CPU (the caller's), for their whole life."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    allowed = os.sched_getaffinity(0)  # pid 0: this thread
    if len(allowed) < 2:
        yield
        return
    cpu = current_cpu()
    if cpu not in allowed:  # /proc silent: spread processes over the CPUs by pid rather than stack them on one
        cpu = sorted(allowed)[os.getpid() % len(allowed)]
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)
