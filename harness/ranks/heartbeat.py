"""A rank's heartbeat file: one JSON line naming the collective it is in, overwritten before
and after every collective, so that whoever launched the ranks can say where each one is stuck.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

HEARTBEAT_ENV = "SPECHARNESS_HEARTBEAT_FILE"  # path of this rank's heartbeat file (set by the launcher)


def write_heartbeat(path: Optional[str], record: dict[str, Any]) -> None:
    """Overwrite `path` with one JSON line (atomically: readers never see half a record)."""
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(record) + "\n")
        os.replace(tmp, path)
    except OSError:  # the parent may already have removed the directory: never fail a collective for it
        pass


def read_heartbeat(path: str) -> Optional[dict[str, Any]]:
    try:
        with open(path) as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None
