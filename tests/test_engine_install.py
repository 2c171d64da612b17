"""harness/engines/install.py: an engine check writes the bytecode of the install's modules it imports, so the
next check of that install does not compile them from source, even where the interpreter runs with -B; and a vLLM
release is its wheel unpacked without the compiled extension modules a CPU check never loads."""
from __future__ import annotations

import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest

from harness.engines import install
from harness.engines.install import MARKER, InstallError, is_installed, provide
from harness.engines.vllm import install as vllm_install
from tests.helpers.engine_releases import BytecodeError, write_bytecode
from tests.helpers.prewarmed import run_python


def _install(tmp_path: Path) -> Path:
    """An install as pip --target leaves it: sources only, no __pycache__."""
    target = tmp_path / "sglang-9.9.9"
    (target / "pkg" / "sub").mkdir(parents=True)
    (target / "pkg" / "__init__.py").write_text("")
    (target / "pkg" / "sub" / "__init__.py").write_text("")
    (target / "pkg" / "sub" / "mod.py").write_text("X = 1\n")
    (target / "pkg" / "sub" / "unused.py").write_text("Y = 2\n")
    return target


def _import_in_a_b_process(target: Path, allow: bool) -> None:
    code = textwrap.dedent(f"""
        import sys
        sys.dont_write_bytecode = True  # as python -B / PYTHONDONTWRITEBYTECODE=1 start it
        from harness.engines.install import write_engine_bytecode
        if {allow!r}:
            write_engine_bytecode()
        sys.path.insert(0, {str(target)!r})
        import pkg.sub.mod
        assert pkg.sub.mod.X == 1
    """)
    proc = run_python(code, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_check_process_writes_the_bytecode_of_what_it_imports_and_nothing_else(tmp_path):
    target = _install(tmp_path)
    tag = sys.implementation.cache_tag
    pyc = target / "pkg" / "sub" / "__pycache__" / f"mod.{tag}.pyc"
    _import_in_a_b_process(target, allow=False)
    assert not pyc.exists()  # the control: -B writes nothing
    _import_in_a_b_process(target, allow=True)
    assert pyc.is_file() and (target / "pkg" / "__pycache__" / f"__init__.{tag}.pyc").is_file()
    assert not (target / "pkg" / "sub" / "__pycache__" / f"unused.{tag}.pyc").exists()  # never imported, never compiled


def _wheel(path: Path, names: list[str]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name in names:
            z.writestr(name, f"# {name}\n")
    return path


WHEEL_FILES = ["vllm/__init__.py", "vllm/v1/worker/gpu/dp_utils.py", "vllm/model_executor/layers/fused_moe/configs/E=8.json",
               "vllm/_C_stable_libtorch.abi3.so", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/libs/libcudart.so.12",
               "vllm-9.9.9.dist-info/METADATA", "vllm-9.9.9.dist-info/RECORD"]


def test_a_wheel_is_unpacked_without_its_compiled_extension_modules(tmp_path):
    wheel = _wheel(tmp_path / "vllm-9.9.9-cp38-abi3-manylinux_2_28_x86_64.whl", WHEEL_FILES)
    target = tmp_path / "engines" / "vllm-9.9.9"
    provide(target, [str(wheel)], log=lambda msg: None, compiled=False)
    got = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file() and p.name != MARKER)
    assert got == sorted(n for n in WHEEL_FILES if ".so" not in n)  # the Python, its data and metadata; no .so, .so.12
    assert is_installed(target) and "without compiled extension modules" in (target / MARKER).read_text()
    assert [p.name for p in target.parent.iterdir()] == ["vllm-9.9.9"]  # no temporary sibling left


def test_a_wheel_with_a_data_directory_is_refused_and_leaves_nothing(tmp_path):
    wheel = _wheel(tmp_path / "vllm-9.9.9-py3-none-any.whl", ["vllm/__init__.py", "vllm-9.9.9.data/scripts/vllm"])
    target = tmp_path / "engines" / "vllm-9.9.9"
    target.parent.mkdir()
    with pytest.raises(InstallError, match=r"vllm-9\.9\.9\.data/ holds files pip would place elsewhere"):
        provide(target, [str(wheel)], log=lambda msg: None, compiled=False)
    assert list(target.parent.iterdir()) == []


def test_vllm_releases_are_unpacked_from_their_wheel_and_their_deps_installed_by_pip(tmp_path, monkeypatch):
    pip: list[list[str]] = []
    unpacked: list[str] = []

    def recorder(calls: list) -> Callable[[Path, Any, Any], None]:
        """An installer that records what it was asked for and installs nothing but the marker."""
        def install_(target: Path, what: Any, log: Any) -> None:
            calls.append(what)
            target.mkdir(parents=True)
            (target / MARKER).write_text("")
        return install_

    monkeypatch.setattr(install, "_pip_target", recorder(pip))
    monkeypatch.setattr(install, "_wheel_target", recorder(unpacked))
    monkeypatch.delenv("SPECHARNESS_WHEELS", raising=False)
    vllm_install.ensure_vllm_installed("0.34.0", tmp_path, log=lambda msg: None)
    assert unpacked == ["vllm==0.34.0"]
    assert pip == [install._dep_requirements(), list(vllm_install.REAL_REQUIREMENTS)]


def test_a_release_that_does_not_load_is_an_error_naming_it_and_is_not_marked_written(tmp_path):
    """The tests' gate loads each install once to write its bytecode (tests/helpers/engine_releases.py): an install the
    engine's loader refuses is an error naming the release, its path and the loader's reason, and stays unmarked, so the
    next test tries again."""
    target = _install(tmp_path)  # no sglang package in it
    with pytest.raises(BytecodeError, match=r"sglang==9\.9\.9 at .*sglang-9\.9\.9 did not load \(to write its bytecode\), exit 1: "
                                            r"(?s:.*)no sglang package under"):
        write_bytecode("sglang==9.9.9", target)
    assert not list(target.glob(".bytecode-*"))
