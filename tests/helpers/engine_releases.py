"""The engine releases a test checks, behind the suite's one network gate.

A release already installed (cached under .engines/, or $SPECHARNESS_ENGINES) is used as it is. One that is not is
installed (under a file lock, so xdist workers share one install) only when the run asks for it with
SPECHARNESS_ENGINE_TESTS=1, as .ci/run's engine step does; otherwise the test skips saying how to run it. So a plain
`pytest -n auto` after the install downloads nothing. The vLLM release table (about 5.4 GB) has an opt-in of its own,
SPECHARNESS_VLLM_TABLE=1, which CI does not set.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import pytest

from harness.engines.install import InstallError, deps_dir, engine_dir, engines_root, ensure_installed, install_lock, is_installed
from harness.engines.vllm.install import ensure_vllm_installed, vllm_deps_dir, vllm_dir
from harness.engines.vllm_ascend.install import RELEASE_FILE, ascend_dir, ensure_ascend_installed
from tests.helpers.prewarmed import run_python

ENGINE_TESTS_ENV = "SPECHARNESS_ENGINE_TESTS"  # "1": tests may install the engine releases they check (network)
VLLM_TABLE_ENV = "SPECHARNESS_VLLM_TABLE"  # "1": the vLLM release table's six extra releases too


def asked(env: str) -> bool:
    return os.environ.get(env, "") not in ("", "0")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr)


ENGINE_MARK = "engine"
ENGINE_STEP = f"`{ENGINE_TESTS_ENV}=1 pytest -n auto -m {ENGINE_MARK}`, .ci/run's engine step"  # what runs the marked tests
_running: Optional[pytest.Item] = None  # the test being set up or run (tests/conftest.py), None outside pytest's run


def begin_test(item: pytest.Item) -> None:
    """Called before a test's fixtures are set up, so that the gate sees which test a module-scoped fixture serves."""
    global _running
    _running = item


def _require_engine_mark(spec: str) -> None:
    """CI's offline step skips a test that needs a release and its engine step selects `-m engine`: an unmarked test
    that needs one would run in neither, so it fails here."""
    if _running is not None and _running.get_closest_marker(ENGINE_MARK) is None:
        pytest.fail(f"{_running.nodeid} needs the engine release {spec} but is not marked @pytest.mark.{ENGINE_MARK}: mark it, so "
                    f"that {ENGINE_STEP} runs it", pytrace=False)


def _provided(spec: str, parts: Sequence[Path], install: Callable[[], Path], opt_in: str, size: str) -> Path:
    """install() when every part is installed already or the run opted in (opt_in=1), its bytecode written; else skip
    with how to run it. Only a test marked engine may ask."""
    _require_engine_mark(spec)
    if all(is_installed(p) for p in parts) or asked(opt_in):
        try:
            path = install()
        except InstallError as e:
            pytest.skip(f"cannot install {spec} here: {e}")
        try:
            write_bytecode(spec, path)
        except BytecodeError as e:
            pytest.fail(str(e))
        return path
    run = f" ({ENGINE_STEP})" if opt_in == ENGINE_TESTS_ENV else ""
    pytest.skip(f"{spec} is not installed under {engines_root()} and installing it downloads {size}: set {opt_in}=1 to let "
                f"tests install engine releases{run}, or install it once: harness engine-check --install --engine {spec}")


class BytecodeError(RuntimeError):
    """An installed release that did not load in the process meant to write its bytecode."""


# engine -> the code that loads an install at {path} as a check does (deps: the SGLang and vLLM dependency dirs)
_LOADS = {
    "sglang": "from harness.engines.sglang.loader import load\nload(Path({path!r}), Path({deps[0]!r}))",
    "vllm": "from harness.engines.vllm.loader import load\nload(Path({path!r}), [Path(d) for d in {deps!r}])",
    "vllm-ascend": ("from harness.engines.vllm_ascend.install import paired_vllm_dir\nfrom harness.engines.vllm_ascend.loader import load\n"
                    "load(Path({path!r}), paired_vllm_dir(Path({path!r})), [Path(d) for d in {deps!r}])"),
}


def write_bytecode(spec: str, path: Path) -> None:
    """Load the install of spec (ENGINE==VERSION) at path once as a check does, writing the bytecode of every module it
    imports; once per install and Python version, under a lock. A release is installed without bytecode and each check
    writes what it compiles, but the tests start several checks of one release side by side (the release and its planted
    copies, in several workers): each would compile the same hundreds of modules from source, none finding another's
    bytecode written yet. The loading process is forked from the server that starts the engine checks
    (tests/helpers/prewarmed.py), so it compiles the release's modules alone."""
    marker = path / f".bytecode-{sys.implementation.cache_tag}"
    if marker.is_file():
        return
    engine = spec.partition("==")[0]
    code = "from pathlib import Path\n" + _LOADS[engine].format(path=str(path), deps=[str(deps_dir()), str(vllm_deps_dir())])
    with install_lock(path.parent, f"bytecode-{path.name}"):
        if not marker.is_file():
            proc = run_python(code, timeout=300)
            if proc.returncode != 0:
                raise BytecodeError(f"{spec} at {path} did not load (to write its bytecode), exit {proc.returncode}: {proc.stderr[-2000:]}")
            marker.write_text(f"loaded by {sys.implementation.cache_tag}: the bytecode of the modules a check imports is written\n")


def installed_release(version: str) -> Path:
    """sglang==version's install, or a skip (see the module docstring)."""
    return _provided(f"sglang=={version}", [deps_dir(), engine_dir(version)], lambda: ensure_installed(version, log=_log),
                     ENGINE_TESTS_ENV, "about 20 MB")


def installed_vllm(version: str, opt_in: str = ENGINE_TESTS_ENV) -> Path:
    """vllm==version's install, or a skip (see the module docstring)."""
    return _provided(f"vllm=={version}", [deps_dir(), vllm_deps_dir(), vllm_dir(version)], lambda: ensure_vllm_installed(version, log=_log),
                     opt_in, "a wheel of about 300 MB")


def installed_ascend(version: str) -> Path:
    """vllm-ascend==version's Python tree (and the vLLM it runs on), or a skip (see the module docstring)."""
    tree = ascend_dir(version)
    parts = [deps_dir(), vllm_deps_dir(), tree]
    if (tree / RELEASE_FILE).exists():  # installed: its vLLM must be too
        parts.append(vllm_dir(json.loads((tree / RELEASE_FILE).read_text())["vllm"]))
    return _provided(f"vllm-ascend=={version}", parts, lambda: ensure_ascend_installed(version, log=_log), ENGINE_TESTS_ENV,
                     "about 15 MB of source and its vLLM release (a wheel of about 300 MB)")
