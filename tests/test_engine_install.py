"""harness/engines/install.py: an install's bytecode is written once, so no check compiles the engine from source."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from harness.engines.install import COMPILED, MARKER, EngineSpec, is_compiled, provide, release_dir


def _installed(tmp_path: Path) -> Path:
    """An install as pip --target leaves it (marker written, no __pycache__)."""
    target = tmp_path / "sglang-9.9.9"
    (target / "pkg" / "sub").mkdir(parents=True)
    (target / "pkg" / "__init__.py").write_text("")
    (target / "pkg" / "sub" / "mod.py").write_text("X = 1\n")
    (target / "pkg" / "sub" / "py2only.py").write_text("print 'written for another Python'\n")
    (target / MARKER).write_text("sglang==9.9.9\n")
    return target


def test_provide_writes_the_bytecode_of_an_install_made_before_once(tmp_path, monkeypatch):
    target = _installed(tmp_path)
    monkeypatch.setattr("harness.engines.install._pip_target", lambda *a, **k: pytest.fail("installed: no pip"))
    logs: list[str] = []
    provide(target, ["sglang==9.9.9"], logs.append)
    tag = sys.implementation.cache_tag
    assert (target / "pkg" / "sub" / "__pycache__" / f"mod.{tag}.pyc").is_file()
    assert (target / "pkg" / "__pycache__" / f"__init__.{tag}.pyc").is_file()
    assert not (target / "pkg" / "sub" / "__pycache__" / f"py2only.{tag}.pyc").exists()  # left to fail where imported
    assert (target / COMPILED).is_file() and is_compiled(target) and COMPILED.endswith(tag)
    assert len(logs) == 1 and "compiled" in logs[0]
    provide(target, ["sglang==9.9.9"], logs.append)
    assert len(logs) == 1  # done once


def test_a_check_of_an_uncompiled_install_compiles_it_without_asking_for_install(tmp_path):
    target = _installed(tmp_path)
    asked: list[str] = []
    spec = EngineSpec.parse("sglang==9.9.9")
    assert release_dir(spec, target, False, lambda v, log: asked.append(v), "how") == target
    assert asked == ["9.9.9"]  # the ensure function (which compiles under the lock) ran
    (target / COMPILED).write_text("")
    release_dir(spec, target, False, lambda v, log: asked.append(v), "how")
    assert asked == ["9.9.9"]
    with pytest.raises(FileNotFoundError, match="how"):
        release_dir(spec, tmp_path / "sglang-0.0.1", False, lambda v, log: asked.append(v), "how")
