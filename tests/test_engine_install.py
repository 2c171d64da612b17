"""harness/engines/install.py: an engine check writes the bytecode of the install's modules it imports, so the
next check of that install does not compile them from source, even where the interpreter runs with -B."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

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
