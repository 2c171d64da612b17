"""Install an SGLang release for `harness engine-check`, side by side with others, cached.

    python -m harness.engines.install sglang==0.5.14 [sglang==0.5.23 ...] [--root DIR]

Each release goes to its own `pip install --no-deps --target ROOT/sglang-VERSION` (the
wheels are cp311 and pure Python for the parts we drive; their declared dependencies pin
CUDA torch builds we must not install). The few modules the runner modules need for real
(requirements/engine.txt: msgspec, dill, regex, packaging; triton when the interpreter
has none) go once to ROOT/deps. Everything else is stubbed by harness/engines/sglang/stubs.py.

ROOT defaults to `.engines/` in the repository (git-ignored), $SPECHARNESS_ENGINES, or for an installed
wheel the user's cache (engines_root).
An install is complete when its `.complete` marker exists; it is built in a temporary
sibling and renamed, under a file lock, so concurrent test workers never see half of one.
Its bytecode is written by the first check that imports it (write_engine_bytecode), for
the modules a check imports: an interpreter that may not write bytecode (PYTHONDONTWRITEBYTECODE,
-B) would otherwise compile hundreds of the engine's modules from source in every check, and
compiling the whole package at install would compile thousands a check never imports.
Nothing here is needed by the core suite.
"""
from __future__ import annotations

import argparse
import fcntl
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

REPO = Path(__file__).resolve().parents[2]
REQUIREMENTS = REPO / "requirements" / "engine.txt"
# The triton pin of requirements/cpu.txt (the triton attention backend): used only when the
# interpreter running the check has no triton of its own.
TRITON_FALLBACK = "triton==3.6.0"
MARKER = ".complete"
_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+!-]*$")


class InstallError(RuntimeError):
    """pip could not install what was asked (no wheel for this interpreter, no network, ...)."""


@dataclass(frozen=True)
class EngineSpec:
    name: str  # "sglang" or "vllm"
    version: Optional[str]  # None: whatever is installed / the newest under ROOT

    @classmethod
    def parse(cls, text: str) -> "EngineSpec":
        name, sep, version = text.strip().partition("==")
        name = name.strip().lower()
        if name not in ("sglang", "vllm"):  # vllm: harness/engines/vllm/install.py
            raise ValueError(f"--engine: 'sglang[==VERSION]' or 'vllm[==VERSION]' (got {text!r})")
        version = version.strip() or None
        if sep and not version:
            raise ValueError(f"--engine: empty version in {text!r}")
        if version is not None and not _VERSION.match(version):
            raise ValueError(f"--engine: {version!r} is not a version")
        return cls(name, version)

    def __str__(self) -> str:
        return self.name if self.version is None else f"{self.name}=={self.version}"


def engines_root(root: Optional[os.PathLike] = None) -> Path:
    """Where installs live: `root`, else $SPECHARNESS_ENGINES, else `.engines/` in a checkout (git-ignored), else (an
    installed wheel, whose package sits in site-packages, no place for engines) the user's cache directory."""
    if root is not None:
        return Path(root)
    env = os.environ.get("SPECHARNESS_ENGINES")
    if env:
        return Path(env)
    if (REPO / "pyproject.toml").is_file():
        return REPO / ".engines"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specharness" / "engines"


def engine_dir(version: str, root: Optional[os.PathLike] = None) -> Path:
    return engines_root(root) / f"sglang-{version}"


def deps_dir(root: Optional[os.PathLike] = None) -> Path:
    return engines_root(root) / "deps"


def is_installed(path: Path) -> bool:
    return (path / MARKER).is_file()


def write_engine_bytecode() -> None:
    """Let this process write the bytecode of what it imports from here on (Python's default, which
    PYTHONDONTWRITEBYTECODE or -B turns off): an engine check runs in a process of its own and imports
    hundreds of the install's modules, which the next check then loads compiled. Each file is written
    atomically by importlib, so concurrent checks of one install are safe."""
    sys.dont_write_bytecode = False


def installed_releases(engine: str, root: Optional[os.PathLike] = None) -> list[str]:
    """The releases of `engine` installed under engines_root(), oldest first in release order (0.9 before 0.34)."""
    base = engines_root(root)
    if not base.is_dir():
        return []
    return sorted((p.name[len(engine) + 1:] for p in base.glob(f"{engine}-[0-9]*") if is_installed(p)), key=version_key)


def release_dir(spec: EngineSpec, target: Path, install: bool, ensure: Callable[..., Path], how: str) -> Path:
    """`target`, the install dir of spec's release: installed first when `install` is set, else an error saying `how`."""
    if not is_installed(target):
        if not install:
            raise FileNotFoundError(f"{spec} is not installed at {target}: {how}")
        ensure(spec.version, log=lambda m: print(m, file=sys.stderr))
    return target


def installed_versions(root: Optional[os.PathLike] = None) -> list[str]:
    return installed_releases("sglang", root)


def version_key(v: str):
    parts = re.findall(r"\d+|[A-Za-z]+", v)
    return [(0, int(p)) if p.isdigit() else (1, p) for p in parts]


@contextmanager
def install_lock(base: Path, name: str) -> Iterator[None]:
    """An exclusive lock of base/.lock-NAME for the block: processes installing (or otherwise writing) one install
    take turns."""
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f".lock-{name}", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run_pip(args: list[str], what: str, log) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    log(f"$ {' '.join(cmd)}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
        raise InstallError(f"pip {what} failed (exit {proc.returncode}): " + " | ".join(tail))


def _built(target: Path, marker: str, fill: Callable[[Path], None]) -> None:
    """target made by fill() in a temporary sibling, marked complete and renamed into place (call under target's lock)."""
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        fill(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / MARKER).write_text(marker + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def _pip_target(target: Path, requirements: list[str], log) -> None:
    _built(target, " ".join(requirements), lambda tmp: _run_pip(
        ["install", "--no-deps", "--no-compile", "--disable-pip-version-check", "-q", "--target", str(tmp), *requirements],
        f"install {' '.join(requirements)}", log))


# A wheel's compiled extension modules (lib.so, lib.so.12): CUDA kernels and C++ ops.
_COMPILED = re.compile(r"\.so(\.[0-9]+)*$")


def _wheel_target(target: Path, requirement: str, log) -> None:
    """requirement's wheel unpacked into target without its compiled extension modules.

    vLLM's wheels carry 0.3-0.6 GB of CUDA libraries each. A check drives the release's Python on a CPU and never loads
    one (without CUDA an import of one fails as the import of a missing module does, with ImportError), so pip's full
    install only cost the time and disk of writing them. requirement: `name==version` (downloaded, no dependencies, a
    wheel for this interpreter) or the path of a wheel."""
    def fill(tmp: Path) -> None:
        download = tmp.with_name(f"{tmp.name}-wheel")
        shutil.rmtree(download, ignore_errors=True)
        try:
            if requirement.endswith(".whl"):
                wheel = Path(requirement)
            else:
                _run_pip(["download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "-q", "-d", str(download),
                          requirement], f"download {requirement}", log)
                wheels = sorted(download.glob("*.whl"))
                if len(wheels) != 1:
                    raise InstallError(f"pip download {requirement} left {[w.name for w in wheels]}, expected one wheel")
                (wheel,) = wheels
            with zipfile.ZipFile(wheel) as z:
                members = z.infolist()
                data = sorted({top for top in (m.filename.split("/", 1)[0] for m in members) if top.endswith(".data")})
                if data:
                    raise InstallError(f"{wheel.name}: its {data[0]}/ holds files pip would place elsewhere; install it with pip")
                z.extractall(tmp, [m for m in members if not _COMPILED.search(m.filename)])
        finally:
            shutil.rmtree(download, ignore_errors=True)

    _built(target, f"{requirement} (without compiled extension modules)", fill)


def provide(target: Path, requirements: list[str], log, compiled: bool = True) -> None:
    """target installed unless it is (call under target's lock): pip --target, or with compiled=False one wheel unpacked
    without its compiled extension modules (_wheel_target)."""
    if not is_installed(target):
        t0 = time.perf_counter()
        if compiled:
            _pip_target(target, requirements, log)
        else:
            (requirement,) = requirements
            _wheel_target(target, requirement, log)
        log(f"installed {' '.join(requirements)} into {target} in {time.perf_counter() - t0:.1f}s")


def _dep_requirements() -> list[str]:
    reqs = [ln.split("#")[0].strip() for ln in REQUIREMENTS.read_text().splitlines()]
    reqs = [r for r in reqs if r]
    if importlib.util.find_spec("triton") is None:
        reqs.append(TRITON_FALLBACK)
    return reqs


def ensure_deps(root: Optional[os.PathLike] = None, log=print) -> Path:
    target = deps_dir(root)
    with install_lock(target.parent, "deps"):
        provide(target, _dep_requirements(), log)
    return target


def ensure_installed(version: str, root: Optional[os.PathLike] = None, log=print) -> Path:
    """Install sglang==version (and the shared deps) under root unless already there; return its directory."""
    if not _VERSION.match(version):
        raise ValueError(f"not a version: {version!r}")
    ensure_deps(root, log)
    target = engine_dir(version, root)
    with install_lock(target.parent, f"sglang-{version}"):
        provide(target, [f"sglang=={version}"], log)
    return target


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.engines.install", description=__doc__.split("\n\n")[0])
    ap.add_argument("engines", nargs="+", help="sglang==VERSION, one or more")
    ap.add_argument("--root", default=None, help="where installs live (default .engines/ or $SPECHARNESS_ENGINES)")
    args = ap.parse_args(argv)
    rc = 0
    for text in args.engines:
        spec = EngineSpec.parse(text)
        if spec.version is None:
            print(f"{text}: give a version (sglang==X.Y.Z)", file=sys.stderr)
            rc = 2
            continue
        try:
            path = ensure_installed(spec.version, args.root)
            print(f"{spec}: {path}")
        except InstallError as e:
            print(f"{spec}: {e}", file=sys.stderr)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
