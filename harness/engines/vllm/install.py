"""Install a vLLM release for `harness engine-check --engine vllm==X`, beside the SGLang installs.

The release's wheel unpacked into ROOT/vllm-VERSION without its compiled extension modules
(`pip download --no-deps`: its declared dependencies pin CUDA torch builds we must not install;
the CUDA libraries it carries are never loaded on a CPU), pydantic and its three helpers once into
ROOT/vllm-deps (stubs.REAL_REQUIREMENTS, pip --target), and the shared deps of harness/engines/install.py.
A wheel already on disk is used when $SPECHARNESS_WHEELS names a directory holding it.
Same cache, marker and lock discipline as the SGLang installs.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from harness.engines.install import engines_root, ensure_deps, install_lock, installed_releases, provide
from harness.engines.vllm.stubs import REAL_REQUIREMENTS

_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+!-]*$")


def vllm_dir(version: str, root: Optional[os.PathLike] = None) -> Path:
    return engines_root(root) / f"vllm-{version}"


def vllm_deps_dir(root: Optional[os.PathLike] = None) -> Path:
    return engines_root(root) / "vllm-deps"


def installed_vllm_versions(root: Optional[os.PathLike] = None) -> list[str]:
    return installed_releases("vllm", root)


def _requirement(version: str) -> str:
    wheels = os.environ.get("SPECHARNESS_WHEELS")
    if wheels:
        found = sorted(Path(wheels).glob(f"vllm-{version}-*.whl"))
        if found:
            return str(found[0])
    return f"vllm=={version}"


def ensure_vllm_installed(version: str, root: Optional[os.PathLike] = None, log=print) -> Path:
    """Install vllm==version (and its real deps) under root unless already there; return its directory."""
    if not _VERSION.match(version):
        raise ValueError(f"not a version: {version!r}")
    ensure_deps(root, log)
    deps = vllm_deps_dir(root)
    with install_lock(deps.parent, "vllm-deps"):
        provide(deps, list(REAL_REQUIREMENTS), log)
    target = vllm_dir(version, root)
    with install_lock(target.parent, f"vllm-{version}"):
        provide(target, [_requirement(version)], log, compiled=False)
    return target
