"""A costly result computed once per test session, whichever xdist workers ask for it.

A module-scoped fixture runs once per worker that runs one of its tests, and xdist hands a module's tests to any free
worker: an engine check read by five tests could run on every worker. Here the first worker to ask computes it under a
file lock and leaves it as JSON in the directory the session's workers share (pytest-xdist's documented pattern:
tmp_path_factory.getbasetemp().parent); the others read it. Without xdist that directory outlives the session, so the
result is computed in the process, as a module-scoped fixture would.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable

import pytest
from filelock import FileLock


def computed_once(tmp_path_factory: pytest.TempPathFactory, key: str, compute: Callable[[], Any]) -> Any:
    """compute()'s JSON-serialisable result, computed by one worker of the session; key names it among the session's."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return compute()
    path = tmp_path_factory.getbasetemp().parent / f"computed-once-{key}.json"
    with FileLock(f"{path}.lock"):
        if path.is_file():
            return json.loads(path.read_text())
        result = compute()  # a failure or a skip leaves nothing behind: the next worker to ask tries again, and says why
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(path)
        return result
