"""The wheel as a user gets it: built from this checkout, installed into a fresh venv, run outside the repo.

torch and numpy come from the running interpreter's site-packages through a .pth file
(pip could not download torch here quickly); the wheel itself is installed with --no-deps,
and PYTHONPATH is unset, so `harness` resolves to the installed copy only.
"""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import harness

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("harness", "runners", "cases", "golden", "pyproject.toml", "setup.py", "MANIFEST.in", "README.md")


def _sh(*args, cwd=None, env=None, timeout=240):
    p = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    pytest.importorskip("setuptools")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", ".*")
    for name in SOURCES:
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy2)(REPO / name, src / name, **({"ignore": ignore} if (REPO / name).is_dir() else {}))
    # the PEP 517 build pip's `wheel --no-build-isolation` runs, called without pip's own start-up around it (the same wheel)
    build = f"import setuptools.build_meta as backend; backend.build_wheel({str(tmp / 'dist')!r})"
    (tmp / "dist").mkdir()
    rc, out, err = _sh(sys.executable, "-c", build, cwd=src)
    assert rc == 0, (out + err)[-3000:]
    (wheel,) = (tmp / "dist").glob("specharness-*.whl")
    venv = tmp / "venv"
    rc, _, err = _sh(sys.executable, "-m", "venv", "--without-pip", venv)
    assert rc == 0, err
    py = venv / "bin" / "python"
    rc, _, err = _sh(sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", wheel)
    assert rc == 0, err[-3000:]
    rc, purelib, err = _sh(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    (Path(purelib.strip()) / "_shared_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    work = tmp / "elsewhere"  # outside the repo: nothing to find by accident
    work.mkdir()
    return venv, Path(purelib.strip()), env, work, wheel


def test_wheel_ships_cases_and_goldens_as_package_data(installed):
    venv, purelib, env, work, wheel = installed
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    for kind, pattern in (("cases", "*.toml"), ("golden", "*.npz"), ("golden", "*.json"), ("golden", "acceptance/*.json")):
        want = {f"harness/_data/{kind}/{p.relative_to(REPO / kind)}" for p in (REPO / kind).glob(pattern)}
        assert want and want <= set(names), sorted(want - set(names))[:5]
    assert "harness/props/reference.md" in names  # what `harness explain` prints


def test_installed_wheel_explains_from_its_own_reference_text(installed):
    venv, purelib, env, work, _ = installed
    rc, out, err = _sh(venv / "bin" / "harness", "explain", "I3", cwd=work, env=env)
    assert rc == 0 and out.startswith("I3 — MLP-TP and attn-TP branches agree"), (out, err)


# `harness check` over every shipped case runs in CI's first step (.ci/run), from the source tree; the wheel's copy
# of every case file and golden is proven by the namelist test above and `harness list` below. So the installed
# wheel checks a representative pair: the TP1 oracle layout, and a DP-attention case in the attn-TP-gather branch.
WHEEL_CHECKED = ("tp1_neither", "tp4_dp2_attn_tp_gather")


@pytest.mark.timeout(600)
def test_installed_wheel_finds_every_shipped_case_and_checks_them_green_outside_the_repo(installed):
    venv, purelib, env, work, _ = installed
    harness_bin = venv / "bin" / "harness"
    rc, out, err = _sh(harness_bin, "--version", cwd=work, env=env)
    assert rc == 0 and out.strip() == f"harness (specharness) {harness.__version__}", (out, err)
    rc, out, err = _sh(harness_bin, "list", "--json", cwd=work, env=env)
    assert rc == 0, err
    listed = json.loads(out)
    assert {c["case"] for c in listed} == {p.stem for p in (REPO / "cases").glob("*.toml")}
    assert all(c["path"].startswith(str(purelib / "harness" / "_data" / "cases")) for c in listed)  # the installed copy, not the repo
    rc, out, err = _sh(harness_bin, "check", "--json", *WHEEL_CHECKED, cwd=work, env=env, timeout=600)  # from package data
    assert rc == 0, (out[-2000:], err[-2000:])
    report = json.loads(out)
    assert report["ok"] and "Traceback" not in err
    assert [c["case"] for c in report["cases"]] == list(WHEEL_CHECKED)
    rc, out, err = _sh(harness_bin, "golden", "check", "tp1_neither", cwd=work, env=env)
    assert rc == 0 and "1 passed, 0 failed" in out, (out[-2000:], err[-2000:])


def test_installed_wheel_installs_engines_in_the_users_cache_not_in_site_packages(installed, tmp_path):
    venv, purelib, env, work, _ = installed
    env = {k: v for k, v in env.items() if k != "SPECHARNESS_ENGINES"} | {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    code = "from harness.engines.install import engine_dir, engines_root; print(engines_root()); print(engine_dir('0.5.23'))"
    rc, out, err = _sh(venv / "bin" / "python", "-c", code, cwd=work, env=env)
    assert rc == 0, err
    assert out.split() == [str(tmp_path / "cache" / "specharness" / "engines"), str(tmp_path / "cache" / "specharness" / "engines" / "sglang-0.5.23")]
    rc, out, err = _sh(venv / "bin" / "python", "-c", code, cwd=work, env=env | {"SPECHARNESS_ENGINES": str(tmp_path / "mine")})
    assert out.split()[0] == str(tmp_path / "mine"), (out, err)


def test_installed_wheel_without_cases_exits_2_saying_where_it_looked(installed, tmp_path):
    venv, purelib, env, work, _ = installed
    rc, out, err = _sh(venv / "bin" / "harness", "check", "--cases-dir", tmp_path, "--json", cwd=work, env=env)
    assert rc == 2 and f"looked in {tmp_path}" in json.loads(out)["error"]["message"]


def test_installed_plugin_is_inert_until_a_conftest_enables_it(installed, tmp_path):
    """The wheel's pytest11 entry point loads into every pytest session of the environment: there it
    only declares options (torch is never imported), items come only where a conftest enables
    harness.plugin, and that conftest line does not register anything twice."""
    venv, purelib, env, work, _ = installed
    other = tmp_path / "other"
    other.mkdir()
    (other / "test_x.py").write_text("import sys\n\n\ndef test_x():\n    assert 'torch' not in sys.modules\n")
    rc, out, err = _sh(venv / "bin" / "python", "-m", "pytest", "-q", "-p", "no:randomly", cwd=other, env=env)
    assert rc == 0 and "1 passed" in out and "specharness" not in out, out + err
    rc, out, err = _sh(venv / "bin" / "python", "-m", "pytest", "--help", cwd=other, env=env)
    assert rc == 0 and "--specharness-props" in out, out + err
    project = tmp_path / "project"
    shutil.copytree(REPO / "tests" / "external_project", project, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    rc, out, err = _sh(venv / "bin" / "python", "-m", "pytest", "-q", "-p", "no:randomly", "--collect-only", "-k", "tp1_neither", cwd=project, env=env)
    assert rc == 0, out + err
    assert [ln for ln in out.splitlines() if "::specharness::" in ln] == [f".::specharness::tp1_neither::{p}" for p in ("P1", "P3", "P4", "golden")]


_EVERY_WRITE = """
import json, sys
from harness import mutants
from harness.cli import main

def run(*argv):
    return main(list(argv))

rcs = {
    "golden record (shipped)": run("golden", "record", "tp1_neither"),
    "golden record --all (shipped)": run("golden", "record", "--all"),
    "new-case (default dir)": run("new-case", "mine", "--tp", "1"),
    "new-case --dir --record": run("new-case", "mine", "--tp", "1", "--steps", "1", "--capture-bs", "1,2", "--max-running-requests", "2",
                                   "--batches", "2 1", "--dir", "mycases", "--record"),
    "golden record --cases-dir": run("golden", "record", "mine", "--cases-dir", "mycases"),
    "check --props all --cases-dir": run("check", "--cases-dir", "mycases", "--props", "all"),
    "check --mutant": run("check", "tp1_neither", "--mutant", "sglang-26416"),
    "golden check --mutant": run("golden", "check", "tp1_neither", "--mutant", "sglang-26416"),
}
with mutants.get("sglang-26416").planted():
    rcs["golden record, a mutant planted"] = run("golden", "record", "mine", "--cases-dir", "mycases")
print(json.dumps(rcs))
"""


def _hashes(root: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.timeout(600)
def test_no_command_or_force_regen_writes_inside_the_installed_package(installed, tmp_path):
    """The issue: force-regen with a mutant overwrote a shipped golden in site-packages. After every recording path
    (the CLI's, new-case --record, the plugin's force-regen with and without a mutant, with a cases dir of one's own)
    every file of the installed package is byte-identical (its bytecode caches aside), and no file was added."""
    venv, purelib, env, work, _ = installed
    env = {k: v for k, v in env.items() if not k.startswith("PYTEST_")}  # a session of its own, not this xdist worker's
    before = _hashes(purelib / "harness")
    assert any(name.startswith("_data/golden/") for name in before)
    project = tmp_path / "project"
    shutil.copytree(REPO / "tests" / "external_project", project, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    rc, out, err = _sh(venv / "bin" / "python", "-c", _EVERY_WRITE, cwd=project, env=env, timeout=500)
    assert rc == 0, err[-3000:]
    assert json.loads(out.splitlines()[-1]) == {
        "golden record (shipped)": 2, "golden record --all (shipped)": 2, "new-case (default dir)": 2, "new-case --dir --record": 0,
        "golden record --cases-dir": 0, "check --props all --cases-dir": 0, "check --mutant": 0, "golden check --mutant": 0,
        "golden record, a mutant planted": 2}, err[-3000:]
    assert "inside the installed specharness package" in err and "is planted" in err
    pytest_ = (venv / "bin" / "python", "-m", "pytest", "-q", "-p", "no:randomly")
    rc, out, err = _sh(*pytest_, "-k", "tp1_neither and golden", "--specharness-force-regen", cwd=project, env=env)
    assert rc == 1 and "refusing to write into" in out and "--specharness-cases-dir DIR" in out, out[-2000:]
    rc, out, err = _sh(*pytest_, "-k", "tp1_neither and golden", "--specharness-force-regen", "--specharness-mutant", "sglang-26416",
                       cwd=project, env=env)
    assert rc == 2 and "refused with --specharness-mutant sglang-26416" in out + err, (out + err)[-2000:]
    rc, out, err = _sh(*pytest_, "-k", "golden and not test_engine", "--specharness-cases-dir=mycases", "--specharness-force-regen",
                       cwd=project, env=env)
    assert rc == 0 and "1 passed" in out, out[-2000:]  # its goldens beside its cases, as new-case --record left them
    assert _hashes(purelib / "harness") == before
