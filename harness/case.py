"""Case files (cases/*.toml): schema, load, validate, with one clear error per mistake.

A user mistake gets a CaseError naming the file, the field path (e.g. `layout.dp_size`)
and what was expected: no traceback, no silently ignored key.
"""
from __future__ import annotations

import tomllib
import zlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

from harness.scenario import Iteration, RequestSpec, Scenario
from runners.attention import BACKENDS
from runners.config import DTYPES, ModelConfig, SpecConfig
from runners.model import check_model_fits_layout
from runners.parallel.layout import LayoutError, ParallelLayout

CASES_DIR = Path(__file__).resolve().parent.parent / "cases"


class CaseError(ValueError):
    def __init__(self, path: Path | str, field: str, expected: str, got: Any = None):
        self.path, self.field, self.expected, self.got = str(path), field, expected, got
        got_s = "" if got is None else f", got {got!r}"
        super().__init__(f"{self.path}: {field}: expected {expected}{got_s}")


@dataclass(frozen=True)
class Case:
    name: str
    description: str
    path: str
    scenario: Scenario
    schedule: tuple[tuple[int, ...], ...]  # per iteration: raw bs of each DP group

    @property
    def layout(self) -> ParallelLayout:
        return self.scenario.layout


_TOP = {"name": str, "description": str, "seed": int, "dtype": str, "backend": str, "model": dict, "spec": dict, "layout": dict, "schedule": dict}
_REQUIRED = ("name", "description", "layout", "schedule")
_LAYOUT = {"tp_size": int, "dp_size": int, "enable_dp_attention": bool, "moe_dense_tp_size": int, "enable_dp_lm_head": bool, "moe_a2a_backend": str}
_SPEC = {"num_steps": int, "topk": int, "num_tokens_per_bs": int, "capture_bs": list, "max_running_requests": int}
_MODEL = {f.name: f.type for f in fields(ModelConfig) if f.name not in ("dtype",)}
_SCHEDULE = {"batches": list, "max_prefix_len": int}
_PY = {"int": int, "float": float, "str": str, "bool": bool}


def _type_name(t) -> str:
    return {int: "an integer", str: "a string", bool: "true or false", list: "a list", dict: "a table", float: "a number"}.get(t, str(t))


def _check_table(path, prefix: str, table: dict, schema: dict) -> None:
    for key, value in table.items():
        where = f"{prefix}{key}"
        if key not in schema:
            raise CaseError(path, where, f"one of the known keys ({', '.join(sorted(schema))})", f"unknown key {key!r}")
        want = schema[key]
        want = _PY.get(want, want) if isinstance(want, str) else want
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        if want is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            raise CaseError(path, where, _type_name(want), value)


def _positive(path, where: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise CaseError(path, where, f"an integer >= {minimum}", value)


def seeded_requests(seed: int, schedule: tuple[tuple[int, ...], ...], T: int, max_prefix_len: int) -> tuple[Iteration, ...]:
    """Deterministic requests for a schedule of batch sizes: prefix and accept lengths from the seed."""
    its, rid = [], 0
    for sizes in schedule:
        groups = []
        for bs in sizes:
            reqs = []
            for _ in range(bs):
                h = zlib.crc32(f"{seed}:{rid}".encode())
                reqs.append(RequestSpec(rid, 1 + h % max_prefix_len, 1 + (h >> 8) % T))
                rid += 1
            groups.append(tuple(reqs))
        its.append(Iteration(tuple(groups)))
    return tuple(its)


def parse_case(data: dict, path: Path | str = "<case>") -> Case:
    path = Path(path)
    _check_table(path, "", data, _TOP)
    for key in _REQUIRED:
        if key not in data:
            raise CaseError(path, key, "a value (this key is required)")
    if data["name"] != path.stem and path.suffix == ".toml":
        raise CaseError(path, "name", f"the file name without .toml ({path.stem!r})", data["name"])
    dtype = data.get("dtype", "float32")
    if dtype not in DTYPES:
        raise CaseError(path, "dtype", f"one of {sorted(DTYPES)}", dtype)
    backend = data.get("backend", "torch")
    if backend not in ("torch", "triton", "flashinfer"):
        raise CaseError(path, "backend", "one of torch, triton, flashinfer", backend)
    if backend not in BACKENDS:
        raise CaseError(path, "backend", f"a backend available in this install ({', '.join(sorted(BACKENDS))})", backend)
    seed = data.get("seed", 0)

    layout_t = data["layout"]
    _check_table(path, "layout.", layout_t, _LAYOUT)
    if "tp_size" not in layout_t:
        raise CaseError(path, "layout.tp_size", "a value (this key is required)")
    try:
        layout = ParallelLayout(**layout_t)
    except LayoutError as e:
        field, _, rule = str(e).partition(": ")
        raise CaseError(path, field, rule) from None

    model_t = data.get("model", {})
    _check_table(path, "model.", model_t, _MODEL)
    model = ModelConfig(**model_t, dtype=dtype)
    try:
        check_model_fits_layout(model, layout)
    except LayoutError as e:
        field, _, rule = str(e).partition(": ")
        raise CaseError(path, field, rule) from None

    spec_t = dict(data.get("spec", {}))
    _check_table(path, "spec.", spec_t, _SPEC)
    for key in ("num_steps", "topk", "num_tokens_per_bs", "max_running_requests"):
        if key in spec_t:
            _positive(path, f"spec.{key}", spec_t[key])
    if "capture_bs" in spec_t:
        cbs = spec_t["capture_bs"]
        if not cbs or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in cbs):
            raise CaseError(path, "spec.capture_bs", "a non-empty list of integers >= 1", cbs)
        spec_t["capture_bs"] = tuple(sorted(set(cbs)))
    if "num_tokens_per_bs" in spec_t:
        spec_t["num_draft_tokens"] = spec_t.pop("num_tokens_per_bs")
    spec = SpecConfig(**spec_t)
    if spec.topk > model.vocab_size:
        raise CaseError(path, "spec.topk", f"at most model.vocab_size ({model.vocab_size})", spec.topk)

    sched_t = data["schedule"]
    _check_table(path, "schedule.", sched_t, _SCHEDULE)
    if "batches" not in sched_t:
        raise CaseError(path, "schedule.batches", "a list of iterations, each a list of per-DP-group batch sizes")
    T = spec.num_tokens_per_bs
    max_prefix = sched_t.get("max_prefix_len", 16)
    _positive(path, "schedule.max_prefix_len", max_prefix)
    if max_prefix + T > model.max_context_len:
        raise CaseError(path, "schedule.max_prefix_len", f"at most model.max_context_len - num_tokens_per_bs ({model.max_context_len - T})", max_prefix)
    batches = sched_t["batches"]
    if not batches:
        raise CaseError(path, "schedule.batches", "at least one iteration", batches)
    dp = layout.attn_dp_size
    schedule = []
    for i, it in enumerate(batches):
        where = f"schedule.batches[{i}]"
        if not isinstance(it, list) or len(it) != dp or not all(isinstance(b, int) and not isinstance(b, bool) for b in it):
            raise CaseError(path, where, f"a list of {dp} integer batch size(s), one per DP group", it)
        for j, b in enumerate(it):
            if b < 0:
                raise CaseError(path, f"{where}[{j}]", "a batch size >= 0 (0 = an idle DP group)", b)
            if b > spec.max_running_requests:
                raise CaseError(path, f"{where}[{j}]", f"at most spec.max_running_requests ({spec.max_running_requests})", b)
        if sum(it) == 0:
            raise CaseError(path, where, "at least one busy DP group", it)
        if dp == 1 and it[0] == 0:
            raise CaseError(path, f"{where}[0]", "a batch size >= 1 without DP attention", 0)
        schedule.append(tuple(it))
    schedule_t = tuple(schedule)
    iterations = seeded_requests(seed, schedule_t, T, max_prefix)
    sc = Scenario(model, spec, layout, iterations, seed=seed, attention_backend=backend, name=data["name"])
    return Case(data["name"], data["description"], str(path), sc, schedule_t)


def load_case(path: Path | str) -> Case:
    path = Path(path)
    if not path.exists():
        named = CASES_DIR / f"{path}.toml"
        if named.exists():
            path = named
        else:
            raise CaseError(path, "<file>", f"an existing case file or the name of one in {CASES_DIR}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise CaseError(path, "<toml>", f"valid TOML ({e})") from None
    except UnicodeDecodeError as e:
        raise CaseError(path, "<file>", f"UTF-8 text ({e.reason})") from None
    return parse_case(data, path)


def default_cases(cases_dir: Optional[Path] = None) -> list[Case]:
    d = cases_dir or CASES_DIR
    return [load_case(p) for p in sorted(d.glob("*.toml"))]
