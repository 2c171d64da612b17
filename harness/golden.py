"""Goldens: golden/<case>.npz + golden/<case>.json (in the spirit of pytest-regressions' ndarrays_regression).

What a golden holds, per rank, per iteration, per draft step of the graph runner (the system
under test): the metadata it used (ints, compared exactly), the token ids it produced (exact),
and its float outputs (logits, logprobs, hidden, topk_p: per-key tolerances). Keys are
`r{rank}.i{iteration}.s{step}.{field}`; per rank and iteration also the requests' ids,
prefix and accept lengths (`r{rank}.i{iteration}.{field}`).

The JSON side records the model fingerprint, a hash of the model weights, a hash of the whole
case config (layout, spec, schedule, seed, backend, dtype) and the versions that made it. A
golden whose fingerprints differ from the case's is refused with the differences named, never
compared. Ranks that hold a bitwise-identical array (e.g. the attn-TP ranks of one DP group)
store it once: the JSON maps the other keys to it (`aliases`).

Writes are atomic and crash-consistent: both files go to hidden temporaries first (fsynced),
then the .npz and the .json are os.replace'd in turn. The JSON carries the sha256 of its .npz, so
a crash between the two replaces is detected and rolled forward on the next load (the temporary
JSON is the journal); a crash before them leaves the old golden untouched. Recording is refused
under pytest-xdist: regenerate serially.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import platform
import stat
import sys
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from harness.case import GOLDEN_FLOAT_FIELDS, Case
from harness.data import shipped_dir
from harness.execute import RankRun
from harness.tolerances import Tol
from runners.cuda_graph import ReplayRecord

GOLDEN_DIR = shipped_dir("golden")
FORMAT = "specharness-golden/1"

# Record and check run the same fp32 CPU code: bitwise equal on one machine. Across CPUs, MKL /
# oneDNN pick other kernels (AVX2 vs AVX-512) and reorder fp32 sums: a few ulps on logits of
# magnitude ~3, three layers deep, as for eager vs graph (harness/tolerances.py EAGER_VS_GRAPH).
# Errors from a wrong or misplaced row are O(1). A case overrides these in [tolerances.golden].
DEFAULT_TOLERANCES: dict[str, Tol] = {
    "logits": Tol(1e-5, 1e-5, "fp32 accumulation reorder across CPU kernels; wrong rows are O(1)"),
    "logprobs": Tol(1e-5, 1e-5, "log_softmax of the logits above"),
    "hidden": Tol(1e-5, 1e-5, "fp32 accumulation reorder across CPU kernels"),
    "topk_p": Tol(1e-5, 1e-5, "exp of the logprobs above"),
}
INT_FIELDS = ("topk_index", "next_input_ids")
# Per step, every metadata int in one packed vector `r.i.s.meta`: for each field in this order, its
# length then its values (length -1: None, no gathered buffer in this branch). One array instead of
# fifteen keeps the .npz small (each entry costs ~250 bytes of zip and npy headers).
META_FIELDS = ("graph_replayed", "raw_bs", "bs", "num_tokens", "global_num_tokens_cpu", "for_logprob_cpu", "dp_buffer_len",
               "capture_num_tokens_gpu", "capture_for_logprob_gpu", "fill_num_tokens_gpu", "fill_for_logprob_gpu",
               "padded_seq_lens", "seq_lens_sum", "rows_fed", "logits_rows")
PAUSE_ENV = "SPECHARNESS_GOLDEN_TEST_PAUSE"  # "<point>:<seconds>", point in {written, between}: tests kill record there


class GoldenError(Exception):
    """A user-facing golden problem (missing, refused, inconsistent): a message, never a traceback."""


class GoldenFormatError(GoldenError):
    """A golden file that is not one (wrong JSON shape, object arrays, not a regular file): bad input, exit 2."""


def show(path) -> str:
    """A path as a user wants to read it: relative to the working directory when inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


# ----------------------------------------------------------------------------------------
# what goes in
# ----------------------------------------------------------------------------------------


def _record_meta(rec: Optional[ReplayRecord], rows_fed: int) -> dict[str, object]:
    if rec is None:  # an eager fallback: no graph replayed
        return {"graph_replayed": 0, "rows_fed": rows_fed}
    host = rec.capture.host
    return {
        "graph_replayed": 1,
        "raw_bs": rec.raw_bs,
        "bs": rec.bs,
        "num_tokens": host["num_tokens"],
        "global_num_tokens_cpu": host["global_num_tokens_cpu"],
        "for_logprob_cpu": host["global_num_tokens_for_logprob_cpu"],
        "dp_buffer_len": host["global_dp_buffer_len"],
        "capture_num_tokens_gpu": rec.capture.global_num_tokens_gpu,
        "capture_for_logprob_gpu": rec.capture.global_num_tokens_for_logprob_gpu,
        "fill_num_tokens_gpu": rec.global_num_tokens_gpu,
        "fill_for_logprob_gpu": rec.global_num_tokens_for_logprob_gpu,
        "padded_seq_lens": rec.padded_seq_lens,
        "seq_lens_sum": rec.seq_lens_sum,
        "rows_fed": rec.rows_fed,
        "logits_rows": rec.logits_rows,
    }


def pack_meta(meta: dict[str, object]) -> np.ndarray:
    out: list[int] = []
    for name in META_FIELDS:
        v = meta.get(name)
        vals = None if v is None else [int(x) for x in (v if isinstance(v, (list, tuple)) else [v])]
        out += [-1] if vals is None else [len(vals), *vals]
    return np.asarray(out, dtype=np.int64)


def unpack_meta(packed: np.ndarray) -> dict[str, Optional[list[int]]]:
    vals, i, out = packed.tolist(), 0, {}
    for name in META_FIELDS:
        if i >= len(vals):
            out[name] = None
            continue
        n = vals[i]
        out[name] = None if n < 0 else vals[i + 1 : i + 1 + n]
        i += 1 + max(n, 0)
    return out


def collect(case: Case, runs: Sequence[RankRun]) -> dict[str, np.ndarray]:
    """Every array a golden holds, from graph-runner runs of the case (runner="graph" or "both")."""
    sc, layout = case.scenario, case.layout
    out: dict[str, np.ndarray] = {}
    for run in runs:
        d = layout.attn_dp_rank(run.rank)
        for it, steps in enumerate(run.graph):
            reqs = sc.iterations[it].per_dp[d]
            base = f"r{run.rank}.i{it}"
            out[f"{base}.requests"] = np.asarray([[r.rid, r.prefix_len, r.accept_len] for r in reqs], dtype=np.int64).reshape(-1, 3)
            recs = run.records[it] if it < len(run.records) else []
            for s, res in enumerate(steps):
                key = f"{base}.s{s}"
                for name in GOLDEN_FLOAT_FIELDS:
                    out[f"{key}.{name}"] = res.tensors[name].detach().to(torch.float32).numpy().copy()
                for name in INT_FIELDS:
                    out[f"{key}.{name}"] = res.tensors[name].detach().to(torch.int64).numpy().copy()
                rec = recs[s] if s < len(recs) else None
                out[f"{key}.meta"] = pack_meta(_record_meta(rec, int(res.tensors["rows_fed"])))
    return out


def run_for_golden(case: Case, ranks: str = "sim") -> list[RankRun]:
    from harness.checks import run_spmd

    return run_spmd(case.scenario, runner="graph", ranks=ranks)


# ----------------------------------------------------------------------------------------
# fingerprints
# ----------------------------------------------------------------------------------------


def case_config(case: Case) -> dict:
    """Everything that decides a golden's contents (not the name, description or tolerances)."""
    sc = case.scenario
    spec = sc.spec
    return {
        "model": asdict(sc.model),
        "spec": {"num_steps": spec.num_steps, "topk": spec.topk, "num_tokens_per_bs": spec.num_tokens_per_bs,
                 "capture_bs": list(spec.capture_bs), "max_running_requests": spec.max_running_requests},
        "layout": asdict(sc.layout),
        "seed": sc.seed,
        "backend": sc.attention_backend,
        "dtype": sc.model.dtype,
        "schedule": [[[[r.rid, r.prefix_len, r.accept_len] for r in group] for group in it.per_dp] for it in sc.iterations],
    }


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def weights_fingerprint(case: Case) -> str:
    """Hash of the draft model's full (TP1) weights: code that changes the weights changes it."""
    from runners.model import DraftModel
    from runners.parallel.dp_attention import RankContext
    from runners.parallel.layout import ParallelLayout

    m = DraftModel(case.scenario.model, case.scenario.spec.num_steps, RankContext(ParallelLayout(), 0, comm=None))
    h = hashlib.sha256()

    def walk(obj, prefix: str) -> None:
        for name in sorted(vars(obj)):
            val = getattr(obj, name)
            if isinstance(val, torch.Tensor):
                h.update(f"{prefix}{name}:{tuple(val.shape)}:{val.dtype}".encode())
                h.update(val.detach().contiguous().view(torch.uint8).numpy().tobytes() if val.numel() else b"")
            elif isinstance(val, list):
                for i, x in enumerate(val):
                    if hasattr(x, "__dict__"):
                        walk(x, f"{prefix}{name}[{i}].")
            elif hasattr(val, "__dict__") and name in ("head", "layer"):
                walk(val, f"{prefix}{name}.")

    walk(m, "")
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Fingerprint:
    model: str
    weights: str
    config: str
    config_dict: dict


def fingerprint(case: Case) -> Fingerprint:
    cfg = case_config(case)
    return Fingerprint(case.scenario.model.fingerprint(), weights_fingerprint(case), _sha(json.dumps(cfg, sort_keys=True).encode())[:16], cfg)


def _flat(d, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    else:
        out[prefix] = d
    return out


def config_changes(old: dict, new: dict, limit: int = 6) -> list[str]:
    """'model.hidden_size 64 -> 128', 'schedule[1] batch [3] -> [2]', ... (first `limit`)."""
    old, new = dict(old), dict(new)
    s_old, s_new = old.pop("schedule", []), new.pop("schedule", [])
    a, b = _flat(old), _flat(new)
    changes = [f"{k} {a.get(k, '<unset>')} -> {b.get(k, '<unset>')}" for k in sorted(set(a) | set(b)) if a.get(k, "<unset>") != b.get(k, "<unset>")]
    if len(s_old) != len(s_new):
        changes.append(f"schedule: {len(s_old)} -> {len(s_new)} iterations")
    for i, (x, y) in enumerate(zip(s_old, s_new, strict=False)):  # a length change is reported above
        if [len(g) for g in x] != [len(g) for g in y]:
            changes.append(f"schedule[{i}] batch {[len(g) for g in x]} -> {[len(g) for g in y]}")
        elif x != y:
            changes.append(f"schedule[{i}] requests (rid, prefix_len, accept_len) {x} -> {y}")
    if len(changes) > limit:
        changes = changes[:limit] + [f"... and {len(changes) - limit} more"]
    return changes


def versions() -> dict[str, str]:
    try:
        from importlib.metadata import version

        ours = version("specharness")
    except Exception:  # noqa: BLE001 - an uninstalled checkout
        ours = "unknown"
    return {"specharness": ours, "torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version(),
            "machine": platform.machine()}


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
def _locked(golden_dir: Path) -> Iterator[None]:
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
        if want is not None and want == _sha(p.npz.read_bytes()):
            os.replace(p.tmp_json, p.json)
            _fsync_dir(p.json.parent)
            return "rolled forward an interrupted record"
    for t in (p.tmp_npz, p.tmp_json):  # killed before any replace: the old golden is intact
        with contextlib.suppress(FileNotFoundError):
            t.unlink()
    return "discarded the temporaries of an interrupted record"


def write_golden(golden_dir: Path, name: str, arrays: dict[str, np.ndarray], meta: dict) -> GoldenPaths:
    """Write the pair atomically (see the module docstring)."""
    golden_dir = Path(golden_dir)
    golden_dir.mkdir(parents=True, exist_ok=True)
    p = GoldenPaths.of(golden_dir, name)
    data = npz_bytes(arrays)
    meta = dict(meta, npz_sha256=_sha(data))
    text = json.dumps(meta, indent=1, sort_keys=True) + "\n"
    with _locked(golden_dir):
        recover(golden_dir, name)
        _write_synced(p.tmp_npz, data)
        _write_synced(p.tmp_json, text.encode())
        _pause("written")
        os.replace(p.tmp_npz, p.npz)
        _pause("between")
        os.replace(p.tmp_json, p.json)
        _fsync_dir(golden_dir)
    return p


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


def _read_regular(path: Path, name: str) -> bytes:
    """The file's bytes; what is not a regular file (a FIFO would block the read) is refused first."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise GoldenFormatError(f"{path}: <file>: expected a readable file ({e.strerror or e}): re-record with `harness golden record {name}`") from None
    if not stat.S_ISREG(st.st_mode):
        raise GoldenFormatError(f"{path}: <file>: expected a regular file, got a directory, FIFO or device: "
                                f"re-record with `harness golden record {name}`")
    try:
        return path.read_bytes()
    except OSError as e:
        raise GoldenFormatError(f"{path}: <file>: expected a readable file ({e.strerror or e})") from None


def _check_meta(path: Path, name: str, meta: object) -> dict:
    """One line naming the file and the field for a golden JSON of the wrong shape."""
    redo = f"re-record with `harness golden record {name}`"
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


def _load_arrays(path: Path, name: str, data: bytes) -> dict[str, np.ndarray]:
    redo = f"re-record with `harness golden record {name}`"
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


def load_golden(golden_dir: Path, name: str) -> Golden:
    golden_dir = Path(golden_dir)
    p = GoldenPaths.of(golden_dir, name)
    if p.tmp_npz.exists() or p.tmp_json.exists():
        with _locked(golden_dir):
            recover(golden_dir, name)
    if not p.json.exists() or not p.npz.exists():
        missing = " and ".join(str(x) for x in (p.npz, p.json) if not x.exists())
        raise GoldenError(f"{name}: no golden ({missing} missing): record it with `harness golden record {name}`")
    raw = _read_regular(p.json, name)
    if len(raw) > MAX_JSON_BYTES:
        raise GoldenFormatError(f"{p.json}: <file>: expected at most {MAX_JSON_BYTES} bytes, got {len(raw)}")
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise GoldenFormatError(f"{p.json}: <json>: expected valid JSON ({e}): re-record with `harness golden record {name}`") from None
    except RecursionError:
        raise GoldenFormatError(f"{p.json}: <json>: expected JSON nested a few levels deep (too deep to parse): re-record with `harness golden record {name}`") from None
    meta = _check_meta(p.json, name, meta)
    data = _read_regular(p.npz, name)
    if meta.get("format") != FORMAT:
        raise GoldenError(f"{p.json}: format {meta.get('format')!r}, this harness reads {FORMAT!r}: re-record with `harness golden record {name}`")
    if meta.get("npz_sha256") != _sha(data):
        raise GoldenError(f"{p.npz} does not match {p.json} (sha256 differs: the pair comes from two records): "
                          f"re-record with `harness golden record {name}`")
    arrays = _load_arrays(p.npz, name, data)
    for key, target in meta.get("aliases", {}).items():
        if target not in arrays:
            raise GoldenFormatError(f"{p.json}: aliases.{key}: expected the name of an array in {p.npz.name}, got {target!r}: "
                                    f"re-record with `harness golden record {name}`")
    return Golden(name, p, meta, arrays)


# ----------------------------------------------------------------------------------------
# compare
# ----------------------------------------------------------------------------------------


def parse_key(key: str) -> tuple[Optional[int], Optional[int], Optional[int], str]:
    """'r3.i1.s2.meta.bs' -> (3, 1, 2, 'meta.bs'); 'r0.i1.rids' -> (0, 1, None, 'rids')."""
    parts = key.split(".")
    rank = it = step = None
    i = 0
    for tag in ("r", "i", "s"):
        if i < len(parts) and parts[i][:1] == tag and parts[i][1:].isdigit():
            val = int(parts[i][1:])
            rank, it, step = (val, it, step) if tag == "r" else (rank, val, step) if tag == "i" else (rank, it, val)
            i += 1
    return rank, it, step, ".".join(parts[i:])


@dataclass
class KeyDiff:
    key: str
    kind: str  # values | shape | dtype | missing | extra
    n_diff: int = 0
    n_total: int = 0
    max_abs: Optional[float] = None
    max_rel: Optional[float] = None
    first: list[tuple[int, ...]] = field(default_factory=list)
    expected: Optional[list] = None  # small integer arrays: the values themselves
    got: Optional[list] = None
    tol: Optional[Tol] = None

    @property
    def where(self) -> tuple[Optional[int], Optional[int], Optional[int], str]:
        return parse_key(self.key)

    def to_json(self) -> dict:
        r, i, s, f = self.where
        d = {"key": self.key, "rank": r, "iteration": i, "step": s, "field": f, "kind": self.kind, "n_diff": self.n_diff, "n_total": self.n_total,
             "percent": round(100.0 * self.n_diff / self.n_total, 4) if self.n_total else None, "max_abs": self.max_abs, "max_rel": self.max_rel,
             "first_indices": [list(x) for x in self.first], "expected": self.expected, "got": self.got}
        if self.tol is not None:
            d["tolerance"] = {"rtol": self.tol.rtol, "atol": self.tol.atol}
        return d


def _field_tol(case: Optional[Case], name: str) -> Optional[Tol]:
    """The tolerance of a float key's field ('r0.i0.s1.logits' -> logits); None: exact."""
    base = name.rsplit(".", 1)[-1]
    if base not in GOLDEN_FLOAT_FIELDS:
        return None
    default = DEFAULT_TOLERANCES[base]
    return case.tol(f"golden.{base}", default) if case is not None else default


def compare_arrays(key: str, ref: np.ndarray, got: np.ndarray, tol: Optional[Tol]) -> Optional[KeyDiff]:
    if ref.dtype.kind != got.dtype.kind:
        return KeyDiff(key, "dtype", expected=[str(ref.dtype)], got=[str(got.dtype)])
    if ref.shape != got.shape:
        return KeyDiff(key, "shape", expected=list(ref.shape), got=list(got.shape), n_total=int(ref.size))
    if ref.size == 0:
        return None
    if tol is None or ref.dtype.kind in "iub":
        bad = ref != got
        tol = None
    else:
        r64, g64 = ref.astype(np.float64), got.astype(np.float64)
        bad = ~np.isclose(g64, r64, rtol=tol.rtol, atol=tol.atol, equal_nan=True)
    n = int(bad.sum())
    if not n:
        return None
    r64, g64 = ref.astype(np.float64), got.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        err = np.abs(g64 - r64)
        rel = err / np.abs(r64)
    err_b, rel_b = err[bad], rel[bad]
    first = [tuple(int(x) for x in idx) for idx in np.argwhere(bad)[:3]]
    diff = KeyDiff(key, "values", n, int(ref.size), float(np.nanmax(err_b)) if np.isfinite(err_b).any() else float("nan"),
                   float(np.nanmax(rel_b[np.isfinite(rel_b)])) if np.isfinite(rel_b).any() else float("inf"), first, tol=tol)
    if ref.dtype.kind in "iub" and ref.size <= 8:
        diff.expected, diff.got = ref.tolist(), got.tolist()
    return diff


@dataclass
class Comparison:
    case: str
    golden_path: str
    diffs: list[KeyDiff] = field(default_factory=list)
    n_keys: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.diffs

    def summary(self) -> str:
        if self.ok:
            return f"{self.case}: matches {self.golden_path} ({self.n_keys} keys)"
        return f"{self.case}: {len(self.diffs)} of {self.n_keys} keys differ from {self.golden_path}"

    def format(self, limit: int = 12) -> str:
        lines = [self.summary()]
        if self.ok:
            return "\n".join(lines + [f"  note: {n}" for n in self.notes])
        head = f"  {'rank':>4} {'iter':>4} {'step':>4}  {'field':<26} {'differ':>20} {'max abs':>9} {'max rel':>9}  first indices / values"
        lines.append(head)
        diffs = sorted(self.diffs, key=lambda d: tuple(-1 if x is None else x for x in d.where[:3]) + (d.where[3],))
        for d in diffs[:limit]:
            r, i, s, f = d.where
            fmt = lambda x: "-" if x is None else str(x)  # noqa: E731
            if d.kind == "values":
                pct = 100.0 * d.n_diff / d.n_total
                differ = f"{d.n_diff}/{d.n_total} ({pct:.3g}%)"
                detail = " ".join(str(x) for x in d.first)
                if d.expected is not None:
                    detail = f"expected {d.expected}, got {d.got}"
                elif d.tol is not None:
                    detail += f"  (rtol={d.tol.rtol:g} atol={d.tol.atol:g})"
                num = lambda x: "-" if x is None or x != x else f"{x:.2e}"  # noqa: E731
                lines.append(f"  {fmt(r):>4} {fmt(i):>4} {fmt(s):>4}  {f:<26} {differ:>20} {num(d.max_abs):>9} {num(d.max_rel):>9}  {detail}")
            else:
                what = {"missing": "in the golden, not produced now", "extra": "produced now, not in the golden"}.get(
                    d.kind, f"{d.kind}: expected {d.expected}, got {d.got}")
                lines.append(f"  {fmt(r):>4} {fmt(i):>4} {fmt(s):>4}  {f:<26} {d.kind:>20} {'-':>9} {'-':>9}  {what}")
        if len(diffs) > limit:
            lines.append(f"  ... and {len(diffs) - limit} more keys")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"case": self.case, "golden": self.golden_path, "ok": self.ok, "keys": self.n_keys, "diffs": [d.to_json() for d in self.diffs],
                "notes": self.notes}


def compare(case: Optional[Case], name: str, ref: dict[str, np.ndarray], got: dict[str, np.ndarray], golden_path: str = "",
            exact: bool = False) -> Comparison:
    """Every key: ints exactly, floats within the case's golden tolerance (exact=True: bitwise)."""
    cmp = Comparison(name, golden_path, n_keys=len(set(ref) | set(got)))
    for key in sorted(set(ref) | set(got)):
        if key not in got:
            cmp.diffs.append(KeyDiff(key, "missing"))
        elif key not in ref:
            cmp.diffs.append(KeyDiff(key, "extra"))
        elif key.endswith(".meta"):
            a, b = unpack_meta(ref[key]), unpack_meta(got[key])
            for name in META_FIELDS:
                if a[name] != b[name]:
                    ra, rb = a[name] or [], b[name] or []
                    n = max(len(ra), len(rb), 1)
                    same_len = len(ra) == len(rb) and a[name] is not None and b[name] is not None
                    bad = [k for k in range(len(ra)) if ra[k] != rb[k]] if same_len else list(range(n))
                    err = max(abs(ra[k] - rb[k]) for k in bad) if same_len else None
                    rel = max(abs(ra[k] - rb[k]) / abs(ra[k]) if ra[k] else float("inf") for k in bad) if same_len else None
                    cmp.diffs.append(KeyDiff(f"{key}.{name}", "values", len(bad), n, float(err) if err is not None else None, rel,
                                             [(k,) for k in bad[:3]], a[name], b[name]))
        else:
            d = compare_arrays(key, ref[key], got[key], None if exact else _field_tol(case, key))
            if d is not None:
                cmp.diffs.append(d)
    return cmp


# ----------------------------------------------------------------------------------------
# record and check
# ----------------------------------------------------------------------------------------


def _refusal(case: Case, golden: Golden, fp: Fingerprint) -> Optional[str]:
    m = golden.meta
    why = []
    if m.get("model_fingerprint") != fp.model:
        why.append(f"model config fingerprint {m.get('model_fingerprint')} -> {fp.model}")
    if m.get("weights_fingerprint") != fp.weights:
        why.append(f"model weights hash {m.get('weights_fingerprint')} -> {fp.weights} (the weight init code changed)")
    if m.get("config_hash") != fp.config:
        why.append(f"case config hash {m.get('config_hash')} -> {fp.config}")
    if not why:
        return None
    changes = config_changes(m.get("config", {}), fp.config_dict)
    msg = (f"{show(golden.paths.json)}: refused, this golden was made with other model weights or config than {show(case.path)}: "
           + "; ".join(why) + (f"; changed: {', '.join(changes)}" if changes else "")
           + f". Not compared. If the change is intended, re-record: harness golden record {case.name}")
    return msg


def check_golden(case: Case, golden_dir: Path = GOLDEN_DIR, runs: Optional[Sequence[RankRun]] = None, ranks: str = "sim") -> Comparison:
    """Compare a fresh graph run of the case with its golden. Raises GoldenError when missing or refused."""
    golden = load_golden(golden_dir, case.name)
    fp = fingerprint(case)
    refused = _refusal(case, golden, fp)
    if refused:
        raise GoldenError(refused)
    got = collect(case, runs if runs is not None else run_for_golden(case, ranks))
    cmp = compare(case, case.name, golden.resolved(), got, show(golden.paths.npz))
    v_then, v_now = golden.meta.get("versions", {}), versions()
    moved = [f"{k} {v_then.get(k)} -> {v_now[k]}" for k in ("torch", "numpy", "machine") if v_then.get(k) != v_now[k]]
    if moved:
        cmp.notes.append("recorded with other versions: " + ", ".join(moved))
    return cmp


def _dedupe(arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Store each distinct array once per field name (the ranks of one attn-TP group produce identical ones)."""
    seen: dict[tuple, str] = {}
    stored, aliases = {}, {}
    for key in sorted(arrays, key=lambda k: (parse_key(k)[0] or 0, k)):
        a = arrays[key]
        sig = (parse_key(key)[3], a.dtype.str, a.shape, hashlib.sha256(np.ascontiguousarray(a).tobytes()).digest())
        if sig in seen:
            aliases[key] = seen[sig]
        else:
            seen.setdefault(sig, key)
            stored[key] = a
    return stored, aliases


@dataclass
class RecordResult:
    case: str
    status: str  # new | changed | unchanged | config-changed
    paths: GoldenPaths
    n_keys: int
    n_bytes: int
    diff: Optional[Comparison] = None
    config_changes: list[str] = field(default_factory=list)
    recovered: Optional[str] = None

    def format(self) -> str:
        size = f"{self.n_keys} keys, {self.n_bytes / 1024:.0f} KiB"
        if self.status == "unchanged":
            return f"{self.case}: unchanged ({size}), {show(self.paths.npz)} not rewritten"
        lines = []
        if self.status == "new":
            lines.append(f"{self.case}: new golden ({size}) -> {show(self.paths.npz)}, {show(self.paths.json)}")
        else:
            lines.append(f"{self.case}: re-recorded ({size}) -> {show(self.paths.npz)}, {show(self.paths.json)}")
        if self.config_changes:
            lines.append("  config changed since the last record: " + ", ".join(self.config_changes))
        if self.diff is not None and not self.diff.ok:
            lines.append("  what changed: " + self.diff.format().replace("\n", "\n  "))
        elif self.diff is not None:
            lines.append("  arrays unchanged; metadata (fingerprints, versions) updated")
        if self.recovered:
            lines.append(f"  ({self.recovered})")
        return "\n".join(lines)


def refuse_under_xdist(golden_dir: Path = GOLDEN_DIR) -> None:
    """Goldens are regenerated serially: xdist workers would race on golden/. (A private directory,
    as tests use under tmp_path, can't race and is allowed.)"""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and Path(golden_dir).resolve() == GOLDEN_DIR.resolve():
        raise GoldenError(f"refusing to record goldens under pytest-xdist (worker {worker}): workers would race on golden/. "
                          "Regenerate serially: harness golden record <case>|--all")


def record_golden(case: Case, golden_dir: Path = GOLDEN_DIR, runs: Optional[Sequence[RankRun]] = None, ranks: str = "sim") -> RecordResult:
    refuse_under_xdist(golden_dir)
    golden_dir = Path(golden_dir)
    arrays = collect(case, runs if runs is not None else run_for_golden(case, ranks))
    fp = fingerprint(case)
    tols = {k: {"rtol": t.rtol, "atol": t.atol, "reason": t.reason} for k in GOLDEN_FLOAT_FIELDS for t in [_field_tol(case, k)]}
    stored, aliases = _dedupe(arrays)
    meta = {"format": FORMAT, "case": case.name, "description": case.description, "runner": "graph", "model_fingerprint": fp.model,
            "weights_fingerprint": fp.weights, "config_hash": fp.config, "config": fp.config_dict, "versions": versions(),
            "tolerances": tols, "meta_fields": list(META_FIELDS), "aliases": aliases, "n_keys": len(arrays)}
    p = GoldenPaths.of(golden_dir, case.name)
    recovered = None
    if p.tmp_npz.exists() or p.tmp_json.exists():
        with _locked(golden_dir):
            recovered = recover(golden_dir, case.name)
    old: Optional[Golden] = None
    with contextlib.suppress(GoldenError):
        old = load_golden(golden_dir, case.name)
    status, diff, changes = "new", None, []
    if old is not None:
        diff = compare(None, case.name, old.resolved(), arrays, show(p.npz), exact=True)  # what changed: every bit that moved
        exact = diff.ok
        changes = config_changes(old.meta.get("config", {}), fp.config_dict) if old.meta.get("config_hash") != fp.config else []
        same_meta = all(old.meta.get(k) == meta[k] for k in ("model_fingerprint", "weights_fingerprint", "config_hash", "versions", "tolerances",
                                                                "description", "aliases"))
        if exact and same_meta:
            return RecordResult(case.name, "unchanged", p, len(arrays), p.npz.stat().st_size, diff, [], recovered)
        status = "config-changed" if changes else "changed"
    write_golden(golden_dir, case.name, stored, meta)
    return RecordResult(case.name, status, p, len(arrays), p.npz.stat().st_size, diff, changes, recovered)


def iter_cases(names: Sequence[str], all_: bool, cases_dir: Optional[Path] = None) -> list[Case]:
    from harness.case import default_cases, load_case

    if names and all_:
        raise GoldenError("name cases or pass --all, not both")
    if not names and not all_:
        raise GoldenError("name a case (e.g. harness golden record tp2_shrink) or pass --all")
    return default_cases(cases_dir) if all_ else [load_case(n, cases_dir) for n in names]

