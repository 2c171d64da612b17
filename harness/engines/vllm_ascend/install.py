"""Install a vllm-ascend release's Python tree for `harness engine-check --engine vllm-ascend==X`, and the vLLM it pairs with.

Every vllm-ascend release is on PyPI as an sdist (some only so: 0.23.0.post1), whose build needs
the CANN toolkit (setup.py compiles the custom ops and asks npu-smi for the chip). What
engine-check drives is plain Python on top of a vLLM release, so the install is: the sdist (its URL and sha256
from PyPI's simple index; a file already on disk when $SPECHARNESS_WHEELS names a directory
holding it), its `vllm_ascend/` package copied to ROOT/vllm-ascend-VERSION, the
`_build_info.py` its setup.py would generate for an Atlas A2 (SOC_VERSION=ascend910b1, the
first example its setup.py gives), and release.json naming the vLLM release its own
compatibility matrix (docs/source/community/versioning_policy.md; a release cut before its
row was written: its Dockerfile's ARG VLLM_TAG) pairs it with, installed
the vLLM adapter's way (harness/engines/vllm/install.py). Same cache, marker and lock
discipline as the other installs.
"""
from __future__ import annotations

import hashlib
import html.parser
import json
import os
import re
import shutil
import tarfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable, Optional

from harness.engines.install import MARKER, InstallError, engines_root, install_lock, installed_releases, is_installed
from harness.engines.vllm.install import ensure_vllm_installed, vllm_dir

PACKAGE = "vllm-ascend"
RELEASE_FILE = "release.json"  # the install's record: the release's version and the vLLM it pairs with
SIMPLE_INDEX = "https://pypi.org/simple/vllm-ascend/"  # PEP 503: one link per file, its sha256 in the URL fragment
MATRIX = "docs/source/community/versioning_policy.md"
DOCKERFILE = "Dockerfile"
BUILD_INFO = "__device_type__ = 'A2'\n"  # setup.py's gen_build_info for SOC_VERSION=ascend910b1
_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+!-]*$")


def ascend_dir(version: str, root: Optional[os.PathLike] = None) -> Path:
    return engines_root(root) / f"{PACKAGE}-{version}"


def installed_ascend_versions(root: Optional[os.PathLike] = None) -> list[str]:
    return installed_releases(PACKAGE, root)


def paired_vllm(matrix_text: str, version: str) -> Optional[str]:
    """The vLLM release a vllm-ascend release runs on, from its compatibility matrix (`| vX | vY | ...`)."""
    for line in matrix_text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0] == f"v{version}" and re.fullmatch(r"v[0-9][0-9A-Za-z.+-]*", cells[1]):
            return cells[1][1:]
    return None


def _sdist(version: str, root: Optional[os.PathLike], log: Callable[[str], None]) -> Path:
    name = f"vllm_ascend-{version}.tar.gz"
    local = os.environ.get("SPECHARNESS_WHEELS")
    if local and (Path(local) / name).is_file():
        return Path(local) / name
    cache = engines_root(root) / "downloads"
    path = cache / name
    if path.is_file():
        return path
    url, sha = sdist_link(version)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{name}.tmp-{os.getpid()}")
    t0 = time.perf_counter()
    log(f"downloading {url}")
    try:
        with urllib.request.urlopen(url, timeout=300) as r, open(tmp, "wb") as fh:
            shutil.copyfileobj(r, fh)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise InstallError(f"downloading {url} failed: {e}") from e
    got = hashlib.sha256(tmp.read_bytes()).hexdigest()
    if got != sha:
        tmp.unlink(missing_ok=True)
        raise InstallError(f"{name}: sha256 {got} is not PyPI's {sha}")
    tmp.rename(path)
    log(f"downloaded {name} ({path.stat().st_size >> 20} MiB) in {time.perf_counter() - t0:.1f}s")
    return path


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: dict[str, str] = {}  # file name -> href
        self._href: Optional[str] = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, Optional[str]]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data: str) -> None:
        if self._href is not None and data.strip():
            self.links[data.strip()] = self._href
            self._href = None


def sdist_link(version: str, index: str = SIMPLE_INDEX) -> tuple[str, str]:
    """(URL, sha256) of vllm_ascend-VERSION.tar.gz on the simple index."""
    name = f"vllm_ascend-{version}.tar.gz"
    try:
        with urllib.request.urlopen(index, timeout=60) as r:
            page = r.read().decode()
    except OSError as e:
        raise InstallError(f"cannot read {index}: {e}") from e
    parser = _Links()
    parser.feed(page)
    href = parser.links.get(name)
    if href is None:
        raise InstallError(f"{index} lists no {name} (PyPI serves {PACKAGE} {version} without an sdist, or not at all)")
    url, _, fragment = urllib.parse.urljoin(index, href).partition("#")
    if not fragment.startswith("sha256="):
        raise InstallError(f"{index}: the link to {name} carries no sha256")
    return url, fragment[len("sha256="):]


def _unpack(sdist: Path, version: str, target: Path) -> tuple[str, str]:
    """The sdist's vllm_ascend/ into target (a fresh dir); the vLLM release it runs on and where that was read: its
    compatibility matrix's row, or (a release cut before its row was written) its Dockerfile's ARG VLLM_TAG."""
    top = f"vllm_ascend-{version}/"
    texts: dict[str, str] = {}
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if m.name in (top + MATRIX, top + DOCKERFILE):
                fh = tar.extractfile(m)
                texts[m.name[len(top):]] = fh.read().decode() if fh else ""
            elif m.name.startswith(top + "vllm_ascend/") and (m.isdir() or m.isfile()):
                m.name = m.name[len(top):]
                members.append(m)
        if not members:
            raise InstallError(f"{sdist} holds no {top}vllm_ascend/")
        tar.extractall(target, members=members, filter="data")
    vllm = paired_vllm(texts.get(MATRIX, ""), version)
    if vllm is not None:
        return vllm, f"{MATRIX}, row v{version}"
    tag = re.search(r"^ARG VLLM_TAG=v([0-9][0-9A-Za-z.+-]*)\s*$", texts.get(DOCKERFILE, ""), re.M)
    if tag is not None:
        return tag.group(1), f"{DOCKERFILE}, ARG VLLM_TAG (no row for v{version} in {MATRIX})"
    raise InstallError(f"{sdist}: no row for v{version} in {MATRIX} and no ARG VLLM_TAG in {DOCKERFILE}: cannot tell which vLLM "
                       "release it runs on")


def ensure_ascend_installed(version: str, root: Optional[os.PathLike] = None, log: Callable[[str], None] = print) -> Path:
    """vllm-ascend==version's Python tree under root (and its vLLM) unless already there; return the tree's directory."""
    if not _VERSION.match(version):
        raise ValueError(f"not a version: {version!r}")
    target = ascend_dir(version, root)
    with install_lock(target.parent, f"{PACKAGE}-{version}"):
        if not is_installed(target):
            sdist = _sdist(version, root, log)
            tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            try:
                vllm, source = _unpack(sdist, version, tmp)
                (tmp / "vllm_ascend" / "_build_info.py").write_text(BUILD_INFO)
                release = {"version": version, "vllm": vllm, "vllm_source": source}
                (tmp / RELEASE_FILE).write_text(json.dumps(release, indent=1) + "\n")
                (tmp / MARKER).write_text(f"{sdist.name}\n")
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
            log(f"installed {PACKAGE}=={version}'s Python tree into {target} (runs on vllm {vllm})")
    release = json.loads((target / RELEASE_FILE).read_text())
    ensure_vllm_installed(release["vllm"], root, log)
    return target


def paired_vllm_dir(tree: Path, root: Optional[os.PathLike] = None) -> Path:
    """The install dir of the vLLM release the tree runs on (its release.json)."""
    path = tree / RELEASE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {RELEASE_FILE} under {tree}: not a {PACKAGE} install of engine-check (install it with --install)")
    return vllm_dir(json.loads(path.read_text())["vllm"], root)
