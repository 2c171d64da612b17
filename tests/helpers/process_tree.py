"""The processes a test may leave behind: this process's children and, since gloo ranks fork from the process's
forkserver (harness.ranks.forkserver), the server's children. The server itself and multiprocessing's resource
tracker live as long as the process does and are not a test's leftovers."""
from __future__ import annotations

import os

SERVICES = ("resource_tracker", "multiprocessing.forkserver")


def _processes() -> list[tuple[int, int, str, str]]:
    """(pid, ppid, state, cmdline) of every process."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out.append((int(d), int(fields[1]), fields[0], cmd[:200]))
    return out


def live_children() -> list[tuple[int, str, str]]:
    """(pid, state, cmdline) of this process's children and its forkserver's, the services aside."""
    procs = _processes()
    me = os.getpid()
    servers = {pid for pid, ppid, _, cmd in procs if ppid == me and "multiprocessing.forkserver" in cmd}
    return [(pid, state, cmd) for pid, ppid, state, cmd in procs
            if (ppid == me or ppid in servers) and not any(s in cmd for s in SERVICES)]
