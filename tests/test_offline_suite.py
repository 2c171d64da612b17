"""A plain `pytest -n auto` after the install downloads nothing: the tests that need an engine release not installed yet
skip, saying how to run them, unless SPECHARNESS_ENGINE_TESTS=1 (which the engine step of .ci/run sets) asks them to install it."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from harness.engines import install
from harness.engines.install import MARKER
from tests.helpers import engine_releases
from tests.helpers.engine_releases import ENGINE_TESTS_ENV, VLLM_TABLE_ENV, installed_release, installed_vllm

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def pip(monkeypatch, tmp_path):
    """An empty engines root, pip replaced by a recorder that installs nothing but the marker, and the process that loads
    an install to write its bytecode by one that records the code it was given."""
    monkeypatch.setenv("SPECHARNESS_ENGINES", str(tmp_path / "engines"))
    monkeypatch.delenv(ENGINE_TESTS_ENV, raising=False)
    monkeypatch.delenv(VLLM_TABLE_ENV, raising=False)
    calls: list[list[str]] = []

    def fake_pip(target: Path, requirements: list[str], log) -> None:
        calls.append(requirements)
        target.mkdir(parents=True)
        (target / MARKER).write_text("")

    def fake_load(code: str, timeout: float) -> subprocess.CompletedProcess:
        calls.append(["load", code])
        return subprocess.CompletedProcess(["python", "-c"], 0, "", "")

    monkeypatch.setattr(install, "_pip_target", fake_pip)
    monkeypatch.setattr(engine_releases, "run_python", fake_load)
    monkeypatch.setattr(engine_releases, "_running", None)  # these tests call the gate as a marked test's fixture would
    return calls


def test_without_the_opt_in_a_missing_release_skips_saying_how_and_pip_never_runs(pip):
    with pytest.raises(pytest.skip.Exception, match=r"sglang==0\.5\.23 is not installed under .* set SPECHARNESS_ENGINE_TESTS=1 .*"
                                                   r"harness engine-check --install --engine sglang==0\.5\.23"):
        installed_release("0.5.23")
    with pytest.raises(pytest.skip.Exception, match="vllm==0.34.0 .* set SPECHARNESS_ENGINE_TESTS=1"):
        installed_vllm("0.34.0")
    with pytest.raises(pytest.skip.Exception, match="set SPECHARNESS_VLLM_TABLE=1"):
        installed_vllm("0.28.0", VLLM_TABLE_ENV)
    assert pip == []


def test_the_opt_in_installs_and_an_installed_release_needs_none(pip, monkeypatch):
    monkeypatch.setenv(ENGINE_TESTS_ENV, "1")
    path = installed_release("0.5.23")
    assert pip[:2] == [install._dep_requirements(), ["sglang==0.5.23"]] and (path / MARKER).is_file()
    (load, code), = pip[2:]  # then loaded once, as a check loads it, to write its bytecode
    assert load == "load" and f"load(Path({str(path)!r})" in code and "harness.engines.sglang.loader" in code
    monkeypatch.delenv(ENGINE_TESTS_ENV)
    assert installed_release("0.5.23") == path and len(pip) == 3  # cached: used without the opt-in, pip and the load not run again


def test_tests_reach_pip_only_through_the_gate_and_ci_opens_it():
    """Every install a test can cause goes through tests/helpers/engine_releases.py; the wheel build and install of
    test_packaging.py stay offline (--no-index)."""
    direct = re.compile(r"\b(ensure_installed|ensure_vllm_installed|ensure_deps|provide)\(|\"--install\"|pip\"?,\s*\"?download")
    for path in sorted(TESTS.rglob("*.py")):
        if path.name in ("engine_releases.py", "test_offline_suite.py", "test_engine_install.py"):
            continue  # the gate itself, and the installer's own tests: pip replaced by recorders, or a wheel made on disk
        text = path.read_text()
        assert not direct.search(text), f"{path.name}: installs an engine outside tests/helpers/engine_releases.py"
        for m in re.finditer(r"\"pip\", (?:\"--python\", \w+, )?\"(install|wheel)\"[^\n]*", text):
            assert "--no-index" in m.group(0), f"{path.name}: pip {m.group(1)} without --no-index: {m.group(0)}"
    ci = (TESTS.parent / ".ci" / "run").read_text()
    assert re.search(r"^pytest -n auto$", ci, re.M), "CI runs the README's plain `pytest -n auto`"
    assert re.search(r"^SPECHARNESS_ENGINES=\S+ SPECHARNESS_ENGINE_TESTS=1 pytest -n auto -m engine$", ci, re.M)
    assert "export SPECHARNESS_ENGINE_TESTS" not in ci  # the opt-in is the engine step's alone


def test_a_test_not_marked_engine_that_needs_a_release_fails_naming_itself_and_the_marker(pip, request, monkeypatch):
    """CI's offline step skips a test that needs a release; its engine step selects `-m engine`. An unmarked one
    would run in neither, so the gate fails it, before it skips or installs anything."""
    monkeypatch.setattr(engine_releases, "_running", request.node)
    monkeypatch.setenv(ENGINE_TESTS_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=r"test_offline_suite\.py::test_a_test_not_marked_engine\S* needs the engine "
                                                    r"release sglang==0\.5\.23 but is not marked @pytest\.mark\.engine: mark it, "
                                                    r"so that `SPECHARNESS_ENGINE_TESTS=1 pytest -n auto -m engine`"):
        installed_release("0.5.23")
    assert pip == []
    request.node.add_marker(pytest.mark.engine)  # marked, it reaches the gate: installed, as the opt-in asks
    assert (installed_release("0.5.23") / MARKER).is_file()
