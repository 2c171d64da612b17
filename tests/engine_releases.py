"""The SGLang release a test checks: installed on first use (cached under .engines/, under a file
lock, so xdist workers share one install), or the test skips with pip's reason."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from harness.engines.install import InstallError, ensure_installed


def installed_release(version: str) -> Path:
    try:
        return ensure_installed(version, log=lambda m: print(m, file=sys.stderr))
    except InstallError as e:
        pytest.skip(f"cannot install sglang=={version} here: {e}")


def require_engine_installs() -> None:
    """Called by tests that download and install an engine release before they do: the opt-in gate for them (none yet:
    such tests install as the others here do, and skip with the installer's reason)."""
