"""The golden on disk: an atomic, crash-consistent write of .npz + .json, and a load that trusts nothing it reads."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import stat
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from harness.golden.base import FORMAT, GOLDEN_DIR, PAUSE_ENV, GoldenError, GoldenFormatError, show
from harness.golden.fingerprint import sha256_hex
from harness.golden.place import check_writable

# ----------------------------------------------------------------------------------------
# files: deterministic npz bytes, atomic pair writes, recovery
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GoldenPaths:
    npz: Path
    json: Path
    tmp_npz: Path
    tmp_json: Path

    @classmethod
    def of(cls, golden_dir: Path, name: str) -> "GoldenPaths":
        d = Path(golden_dir)
        return cls(d / f"{name}.npz", d / f"{name}.json", d / f".{name}.npz.tmp", d / f".{name}.json.tmp")


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An .npz (np.load reads it) with fixed zip timestamps: identical arrays give identical bytes."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key in sorted(arrays):
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            arr_buf = io.BytesIO()
            np.lib.format.write_array(arr_buf, np.ascontiguousarray(arrays[key]), allow_pickle=False)
            zf.writestr(info, arr_buf.getvalue())
    return buf.getvalue()


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def golden_lock(golden_dir: Path) -> Iterator[None]:
    """One golden writer (or recoverer) per directory at a time; a no-op where the dir is read-only."""
    try:
        import fcntl

        f = open(Path(golden_dir) / ".lock", "a+")
    except (ImportError, OSError):
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _pause(point: str) -> None:
    spec = os.environ.get(PAUSE_ENV, "")
    if spec.partition(":")[0] == point:
        print(f"golden: paused at {point}", file=sys.stderr, flush=True)
        time.sleep(float(spec.partition(":")[2] or 60))


def recover(golden_dir: Path, name: str) -> Optional[str]:
    """Finish or discard what an interrupted record left. Returns what was done, if anything."""
    p = GoldenPaths.of(golden_dir, name)
    if not (p.tmp_npz.exists() or p.tmp_json.exists()):
        return None
    if p.tmp_json.exists() and not p.tmp_npz.exists() and p.npz.exists():
        # killed between the two replaces: the new .npz is in place, its .json is the journal
        try:
            want = json.loads(p.tmp_json.read_text())["npz_sha256"]
        except (ValueError, KeyError, OSError):
            want = None
        if want is not None and want == sha256_hex(p.npz.read_bytes()):
            os.replace(p.tmp_json, p.json)
            _fsync_dir(p.json.parent)
            return "rolled forward an interrupted record"
    for t in (p.tmp_npz, p.tmp_json):  # killed before any replace: the old golden is intact
        with contextlib.suppress(FileNotFoundError):
            t.unlink()
    return "discarded the temporaries of an interrupted record"


def write_golden(golden_dir: Path, name: str, arrays: dict[str, np.ndarray], meta: dict) -> GoldenPaths:
    """Write the pair atomically (see the module docstring); never into the installed package or with a mutant planted."""
    golden_dir = Path(golden_dir)
    check_writable(golden_dir)
    golden_dir.mkdir(parents=True, exist_ok=True)
    p = GoldenPaths.of(golden_dir, name)
    data = npz_bytes(arrays)
    meta = dict(meta, npz_sha256=sha256_hex(data))
    text = json.dumps(meta, indent=1, sort_keys=True) + "\n"
    with golden_lock(golden_dir):
        recover(golden_dir, name)
        _write_synced(p.tmp_npz, data)
        _write_synced(p.tmp_json, text.encode())
        _pause("written")
        os.replace(p.tmp_npz, p.npz)
        _pause("between")
        os.replace(p.tmp_json, p.json)
        _fsync_dir(golden_dir)
    return p


def write_text_atomic(path: Path, text: str) -> None:
    """One-file goldens (acceptance, draft trees): a synced temporary, then os.replace under the directory's lock;
    a crash leaves the old file or the new one, never half of one."""
    d = path.parent
    check_writable(d)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{path.name}.tmp"
    with golden_lock(d):
        _write_synced(tmp, text.encode())
        os.replace(tmp, path)
        _fsync_dir(d)


@dataclass
class Golden:
    name: str
    paths: GoldenPaths
    meta: dict
    arrays: dict[str, np.ndarray]

    def resolved(self) -> dict[str, np.ndarray]:
        out = dict(self.arrays)
        for key, target in self.meta.get("aliases", {}).items():
            out[key] = self.arrays[target]
        return out


_META_TYPES = {"format": str, "npz_sha256": str, "aliases": dict, "versions": dict, "config": dict, "tolerances": dict, "model_fingerprint": str,
               "weights_fingerprint": str, "config_hash": str}
MAX_JSON_BYTES = 16 << 20


def _read_regular(path: Path, redo: str) -> bytes:
    """The file's bytes; what is not a regular file (a FIFO would block the read) is refused first."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise GoldenFormatError(f"{path}: <file>: expected a readable file ({e.strerror or e}): {redo}") from None
    if not stat.S_ISREG(st.st_mode):
        raise GoldenFormatError(f"{path}: <file>: expected a regular file, got a directory, FIFO or device: {redo}")
    try:
        return path.read_bytes()
    except OSError as e:
        raise GoldenFormatError(f"{path}: <file>: expected a readable file ({e.strerror or e})") from None


def _check_meta(path: Path, redo: str, meta: object) -> dict:
    """One line naming the file and the field for a golden JSON of the wrong shape."""
    if not isinstance(meta, dict):
        raise GoldenFormatError(f"{path}: <top level>: expected a JSON object, got {type(meta).__name__}: {redo}")
    for key, want in _META_TYPES.items():
        if key in meta and not isinstance(meta[key], want):
            raise GoldenFormatError(f"{path}: {key}: expected {'an object' if want is dict else 'a string'}, got {type(meta[key]).__name__}: {redo}")
    for key in ("aliases", "versions"):
        bad = [k for k, v in meta.get(key, {}).items() if not isinstance(v, str)]
        if bad:
            raise GoldenFormatError(f"{path}: {key}.{bad[0]}: expected a string, got {type(meta[key][bad[0]]).__name__}: {redo}")
    return meta


def _load_arrays(path: Path, redo: str, data: bytes) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            for key in z.files:
                try:
                    arrays[key] = z[key]
                except ValueError as e:  # object arrays: allow_pickle=False refuses them
                    raise GoldenFormatError(f"{path}: {key}: expected a numeric array ({e}): {redo}") from None
    except GoldenFormatError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError) as e:
        raise GoldenFormatError(f"{path}: <npz>: expected an .npz of numeric arrays ({type(e).__name__}: {e}): {redo}") from None
    for key, a in arrays.items():
        if a.dtype.kind not in "fiub" or a.dtype.names is not None:
            raise GoldenFormatError(f"{path}: {key}: expected a numeric array, got dtype {a.dtype}: {redo}")
        if key.endswith(".meta") and (a.dtype.kind not in "iu" or a.ndim != 1):
            raise GoldenFormatError(f"{path}: {key}: expected a 1-D integer array (packed metadata), got {a.dtype} of shape {a.shape}: {redo}")
    return arrays


def load_golden(golden_dir: Path, name: str, record_cmd: Optional[str] = None) -> Golden:
    """The golden `name` in golden_dir, checked; every error ends with the command that (re)records it (record_cmd,
    harness.golden.place.record_command; default: `harness golden record NAME --golden-dir DIR`)."""
    golden_dir = Path(golden_dir)
    shipped = golden_dir.resolve() == GOLDEN_DIR.resolve()
    record_cmd = record_cmd or f"harness golden record {name}" + ("" if shipped else f" --golden-dir {shlex.quote(show(golden_dir))}")
    redo = f"re-record with `{record_cmd}`"
    p = GoldenPaths.of(golden_dir, name)
    if p.tmp_npz.exists() or p.tmp_json.exists():
        with golden_lock(golden_dir):
            recover(golden_dir, name)
    if not p.json.exists() or not p.npz.exists():
        missing = " and ".join(str(x) for x in (p.npz, p.json) if not x.exists())
        raise GoldenError(f"{name}: no golden ({missing} missing): record it with `{record_cmd}`")
    raw = _read_regular(p.json, redo)
    if len(raw) > MAX_JSON_BYTES:
        raise GoldenFormatError(f"{p.json}: <file>: expected at most {MAX_JSON_BYTES} bytes, got {len(raw)}")
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise GoldenFormatError(f"{p.json}: <json>: expected valid JSON ({e}): {redo}") from None
    except RecursionError:
        raise GoldenFormatError(f"{p.json}: <json>: expected JSON nested a few levels deep (too deep to parse): {redo}") from None
    meta = _check_meta(p.json, redo, meta)
    data = _read_regular(p.npz, redo)
    if meta.get("format") != FORMAT:
        raise GoldenError(f"{p.json}: format {meta.get('format')!r}, this harness reads {FORMAT!r}: {redo}")
    if meta.get("npz_sha256") != sha256_hex(data):
        raise GoldenError(f"{p.npz} does not match {p.json} (sha256 differs: the pair comes from two records): {redo}")
    arrays = _load_arrays(p.npz, redo, data)
    for key, target in meta.get("aliases", {}).items():
        if target not in arrays:
            raise GoldenFormatError(f"{p.json}: aliases.{key}: expected the name of an array in {p.npz.name}, got {target!r}: {redo}")
    return Golden(name, p, meta, arrays)
