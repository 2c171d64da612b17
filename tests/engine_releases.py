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
