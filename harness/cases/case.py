"""Case files (cases/*.toml): schema, load, validate, with one clear error per mistake.

A user mistake gets a CaseError naming the file, the field path (e.g. `layout.dp_size`)
and what was expected: no traceback, no silently ignored key.
"""
from __future__ import annotations

import difflib
import os
import re
import stat
import tomllib
from dataclasses import dataclass, fields
from dataclasses import field as dc_field
from pathlib import Path
from typing import Any, Optional

from harness.cases.budget import MAX_ITERATIONS, over_budget
from harness.cases.data import shipped_dir
from harness.cases.requests import seeded_requests, with_explicit_lens
from harness.props.tolerances import Tol
from harness.run.scenario import Scenario
from runners.attention import BACKENDS
from runners.attention.kinds import METADATA_IN_GRAPH, ONE_GRAPH_UNSUPPORTED, RAGGED_UNSUPPORTED, AttentionBackend
from runners.config import DTYPES, SPEC_OPTIONS, DraftExtendGraph, DraftExtendShape, ModelConfig, SpecConfig
from runners.draft_parallel import check_draft_config
from runners.model import check_model_fits_layout
from runners.parallel.layout import LayoutError, ParallelLayout

CASES_DIR = shipped_dir("cases")


class CaseError(ValueError):
    """A case file the loader refuses: one line naming the file, the field and what was expected (the CLI's exit 2)."""
    def __init__(self, path: Path | str, field: str, expected: str, got: Any = None):
        self.path, self.field, self.expected, self.got = str(path), field, expected, got
        got_s = "" if got is None else f", got {_short(got)}"
        # one line, always: a user mistake is a message, never a traceback or a wall of text
        super().__init__(f"{self.path}: {field}: expected {expected}{got_s}".replace("\n", " "))


class _Verbatim(str):
    """A `got` shown as is (not repr-quoted)."""

    def __repr__(self) -> str:
        return str(self)


def _short(value: Any, limit: int = 120) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


@dataclass(frozen=True)
class Case:
    """One parallel config under test: layout, spec and model (`scenario`), each DP group's batch size per iteration
    (`schedule`), tolerance overrides with reasons. Checks, goldens and plugin items are keyed by it; see load_case."""
    name: str
    description: str
    path: str
    scenario: Scenario
    schedule: tuple[tuple[int, ...], ...]  # per iteration: raw bs of each DP group
    # [tolerances]: "eager_vs_graph", "cross_layout", "golden.<field>" -> Tol (overrides of harness/props/tolerances.py)
    tolerances: dict[str, Tol] = dc_field(default_factory=dict)
    top_logprobs_num: Optional[int] = None  # schedule.top_logprobs_num: the loop's requests ask for logprobs (None: none)

    @property
    def layout(self) -> ParallelLayout:
        return self.scenario.layout

    def tol(self, key: str, default: Optional[Tol] = None) -> Optional[Tol]:
        """The case's override for `key` (e.g. "golden.logits", "eager_vs_graph"), else `default`."""
        return self.tolerances.get(key, default)


_TOP = {"name": str, "description": str, "seed": int, "dtype": str, "backend": str, "model": dict, "spec": dict, "layout": dict, "schedule": dict,
        "tolerances": dict}
_REQUIRED = ("name", "description", "layout", "schedule")
_LAYOUT = {"tp_size": int, "dp_size": int, "enable_dp_attention": bool, "moe_dense_tp_size": int, "enable_dp_lm_head": bool, "moe_a2a_backend": str,
           "enable_two_batch_overlap": bool}
_SPEC = {"num_steps": int, "topk": int, "num_tokens_per_bs": int, "capture_bs": list, "max_running_requests": int, "page_size": int,
         "draft": str, "draft_extend_graph": str, "eagle_aux_hidden_state_layer_ids": list, "draft_vocab_size": int,
         "draft_tp_size": int, "draft_max_position_embeddings": int, "draft_rope_theta": float,
         "dp_spec_prefill_coordination": bool, "overlap_schedule": bool,
         **dict.fromkeys(SPEC_OPTIONS, str)}
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64)  # KV slots per page: a power of two (runners.memory.check_page_size), at most 64
_MODEL = {f.name: f.type for f in fields(ModelConfig) if f.name not in ("dtype",)}
_SCHEDULE = {"batches": list, "max_prefix_len": int, "prefix_lens": list, "accept_lens": list, "rids": list, "top_logprobs_num": int}
_TOLERANCES = {"eager_vs_graph": dict, "cross_layout": dict, "golden": dict}
_TOL = {"rtol": float, "atol": float, "reason": str}
GOLDEN_FLOAT_FIELDS = ("logits", "logprobs", "hidden", "topk_p")  # the float keys a golden stores (harness/golden/)
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# What one rank's worker holds (runners/draft_extend.py DraftWorker): request pool 128 (index 0 reserved), 4096 KV slots (slot 0 padding).
MAX_REQUESTS_PER_RANK = 127
MAX_KV_SLOTS_PER_RANK = 4095
# model.<key>: (minimum, maximum) so that a typo cannot ask for gigabytes or a zero-sized model
_MODEL_RANGES = {"hidden_size": (2, 4096), "num_heads": (1, 64), "num_kv_heads": (1, 64), "intermediate_size": (1, 16384), "vocab_size": (2, 65536),
                 "num_target_layers": (1, 16), "max_context_len": (2, 4096), "seed": (0, 2**31 - 1)}
_SPEC_MAX = {"num_steps": 16, "topk": 64, "num_tokens_per_bs": 64, "max_running_requests": MAX_REQUESTS_PER_RANK}
_PY = {"int": int, "float": float, "str": str, "bool": bool}
MAX_CASE_BYTES = 1 << 20  # a case file is a few hundred bytes; more is not a case
MAX_WORLD_SIZE = 64  # ranks of one case: simulated ranks are threads of one process, and model.num_heads is at most 64


def _type_name(t) -> str:
    return {int: "an integer", str: "a string", bool: "true or false", list: "a list", dict: "a table", float: "a number"}.get(t, str(t))


def _check_table(path, prefix: str, table: dict, schema: dict) -> None:
    for key, value in table.items():
        where = f"{prefix}{key}"
        if key not in schema:
            close = difflib.get_close_matches(str(key), list(schema), n=1)
            hint = f"{close[0]!r} (did you mean it?) or another of " if close else "one of "
            raise CaseError(path, where, f"{hint}the known keys ({', '.join(sorted(schema))})", _Verbatim(f"unknown key {key!r}"))
        want = schema[key]
        want = _PY.get(want, want) if isinstance(want, str) else want
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        if want is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            raise CaseError(path, where, _type_name(want), value)


def _positive(path, where: str, value: int, minimum: int = 1, maximum: Optional[int] = None) -> None:
    if value < minimum or (maximum is not None and value > maximum):
        raise CaseError(path, where, f"an integer >= {minimum}" if maximum is None else f"an integer in {minimum}..{maximum}", value)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_model(path, model_t: dict, dtype: str) -> ModelConfig:
    _check_table(path, "model.", model_t, _MODEL)
    for key, (lo, hi) in _MODEL_RANGES.items():
        if key in model_t:
            _positive(path, f"model.{key}", model_t[key], lo, hi)
    for key in ("rope_theta", "rms_eps"):
        if key in model_t and not 0 < model_t[key] < 1e12:
            raise CaseError(path, f"model.{key}", "a number > 0", model_t[key])
    model = ModelConfig(**model_t, dtype=dtype)
    if model.hidden_size % model.num_heads:
        raise CaseError(path, "model.hidden_size", f"a multiple of model.num_heads ({model.num_heads})", model.hidden_size)
    if model.head_dim % 2:
        raise CaseError(path, "model.hidden_size", f"an even head_dim (hidden_size / num_heads) for RoPE, got head_dim {model.head_dim}", model.hidden_size)
    if model.num_heads % model.num_kv_heads:
        raise CaseError(path, "model.num_kv_heads", f"a divisor of model.num_heads ({model.num_heads})", model.num_kv_heads)
    return model


def _parse_tolerances(path, tol_t: dict) -> dict[str, Tol]:
    """[tolerances]: eager_vs_graph / cross_layout / golden.<field> = { rtol = .., atol = .., reason = ".." }."""
    _check_table(path, "tolerances.", tol_t, _TOLERANCES)
    items: list[tuple[str, Any]] = [(k, v) for k, v in tol_t.items() if k != "golden"]
    golden = tol_t.get("golden", {})
    for k, v in golden.items():
        if k not in GOLDEN_FLOAT_FIELDS:
            raise CaseError(path, f"tolerances.golden.{k}", f"one of the golden float fields ({', '.join(GOLDEN_FLOAT_FIELDS)})", f"unknown key {k!r}")
        items.append((f"golden.{k}", v))
    out = {}
    for key, t in items:
        where = f"tolerances.{key}"
        if not isinstance(t, dict):
            raise CaseError(path, where, "an inline table { rtol = .., atol = .. }", t)
        _check_table(path, where + ".", t, _TOL)
        for part in ("rtol", "atol"):
            if part not in t:
                raise CaseError(path, f"{where}.{part}", "a number >= 0 (this key is required)")
            if not 0 <= t[part] <= 1e6:
                raise CaseError(path, f"{where}.{part}", "a number >= 0", t[part])
        out[key] = Tol(float(t["rtol"]), float(t["atol"]), t.get("reason", f"set in {Path(path).name}"))
    return out


def _explicit_lens(path, sched_t: dict, key: str, schedule: tuple[tuple[int, ...], ...], lo: int, hi: int, what: str) -> Optional[list]:
    """schedule.prefix_lens / schedule.accept_lens: per iteration, per DP group, one integer per request."""
    if key not in sched_t:
        return None
    value = sched_t[key]
    if len(value) != len(schedule):
        raise CaseError(path, f"schedule.{key}", f"one entry per iteration of schedule.batches ({len(schedule)})", value)
    for i, (it, sizes) in enumerate(zip(value, schedule, strict=True)):
        where = f"schedule.{key}[{i}]"
        if not isinstance(it, list) or len(it) != len(sizes):
            raise CaseError(path, where, f"a list of {len(sizes)} list(s), one per DP group", it)
        for j, (group, bs) in enumerate(zip(it, sizes, strict=True)):
            if not isinstance(group, list) or len(group) != bs or not all(_is_int(x) for x in group):
                raise CaseError(path, f"{where}[{j}]", f"a list of {bs} integer(s), one per request (schedule.batches[{i}][{j}] = {bs})", group)
            for k, x in enumerate(group):
                if not lo <= x <= hi:
                    raise CaseError(path, f"{where}[{j}][{k}]", f"{what} in {lo}..{hi}", x)
    return value


def _check_budget(path, model: ModelConfig, layout: ParallelLayout, spec: SpecConfig, iterations: int) -> None:
    if iterations > MAX_ITERATIONS:
        raise CaseError(path, "schedule.batches", f"at most {MAX_ITERATIONS} iterations (the resource budget)", _Verbatim(f"{iterations} iterations"))
    over = over_budget(model, layout, spec)
    if over is not None:
        raise CaseError(path, "model", over[0], _Verbatim(over[1]))


def parse_layout(path: Path | str, layout_t: dict) -> ParallelLayout:
    """[layout] as a ParallelLayout; a CaseError names the field, the rule and the field's own value."""
    _check_table(path, "layout.", layout_t, _LAYOUT)
    if "tp_size" not in layout_t:
        raise CaseError(path, "layout.tp_size", "a value (this key is required)")
    for key, hi in (("tp_size", MAX_WORLD_SIZE), ("dp_size", MAX_WORLD_SIZE)):
        if key in layout_t:  # before any rule between them: a huge tp_size is reported as itself
            _positive(path, f"layout.{key}", layout_t[key], 1, hi)
    try:
        return ParallelLayout(**layout_t)
    except LayoutError as e:
        field, _, rule = str(e).partition(": ")
        rule = rule.split(" (got ParallelLayout(")[0]  # the field's own value is what a user needs to see
        raise CaseError(path, field, rule, layout_t.get(field.rpartition(".")[2])) from None


def parse_case(data: dict, path: Path | str = "<case>") -> Case:
    path = Path(path)
    _check_table(path, "", data, _TOP)
    for key in _REQUIRED:
        if key not in data:
            raise CaseError(path, key, "a value (this key is required)")
    if not NAME_RE.fullmatch(data["name"]):
        raise CaseError(path, "name", "letters, digits, '_', '-' or '.', starting with a letter or digit (it names golden/<name>.npz)", data["name"])
    if data["name"] != path.stem and path.suffix == ".toml":
        raise CaseError(path, "name", f"the file name without .toml ({path.stem!r})", data["name"])
    dtype = data.get("dtype", "float32")
    if dtype not in DTYPES:
        raise CaseError(path, "dtype", f"one of {sorted(DTYPES)}", dtype)
    try:
        backend = AttentionBackend(data.get("backend", "torch"))
    except (ValueError, TypeError):
        raise CaseError(path, "backend", f"one of {', '.join(AttentionBackend)}", data.get("backend")) from None
    if backend not in BACKENDS:
        raise CaseError(path, "backend", f"a backend available in this install ({', '.join(sorted(BACKENDS))})", backend)
    seed = data.get("seed", 0)
    _positive(path, "seed", seed, 0, 2**31 - 1)

    layout = parse_layout(path, data["layout"])

    model = _parse_model(path, data.get("model", {}), dtype)
    try:
        check_model_fits_layout(model, layout)
    except LayoutError as e:
        field, _, rule = str(e).partition(": ")
        raise CaseError(path, field, rule) from None

    spec_t = dict(data.get("spec", {}))
    _check_table(path, "spec.", spec_t, _SPEC)
    for key in ("num_steps", "topk", "num_tokens_per_bs", "max_running_requests"):
        if key in spec_t:
            _positive(path, f"spec.{key}", spec_t[key], 1, _SPEC_MAX[key])
    if "capture_bs" in spec_t:
        cbs = spec_t["capture_bs"]
        if not cbs or not all(_is_int(b) and 1 <= b <= 1024 for b in cbs):
            raise CaseError(path, "spec.capture_bs", "a non-empty list of integers in 1..1024", cbs)
        spec_t["capture_bs"] = tuple(sorted(set(cbs)))
    if "page_size" in spec_t and spec_t["page_size"] not in PAGE_SIZES:
        raise CaseError(path, "spec.page_size", f"one of {', '.join(map(str, PAGE_SIZES))} (KV slots per page, a power of two)", spec_t["page_size"])
    if "draft_extend_graph" in spec_t:
        graph = spec_t["draft_extend_graph"]
        if not isinstance(graph, str) or graph not in set(DraftExtendGraph):
            raise CaseError(path, "spec.draft_extend_graph", f"one of {', '.join(DraftExtendGraph)} (a graph per draft step, or one for every step)", graph)
        if graph == DraftExtendGraph.ONE_GRAPH and spec_t.get("draft", "multi_layer") != "multi_layer":
            raise CaseError(path, "spec.draft_extend_graph", f"per_step with draft = {spec_t['draft']} (its draft-extend is one step)", graph)
        if graph == DraftExtendGraph.ONE_GRAPH and backend not in METADATA_IN_GRAPH:
            raise CaseError(path, "spec.draft_extend_graph", f"per_step with backend = {backend} ({ONE_GRAPH_UNSUPPORTED})", graph)
    if spec_t.get("draft_extend_shape") == DraftExtendShape.RAGGED and backend not in METADATA_IN_GRAPH:
        raise CaseError(path, "spec.draft_extend_shape", f"fixed with backend = {backend} ({RAGGED_UNSUPPORTED})", "ragged")
    if "num_tokens_per_bs" in spec_t:
        spec_t["num_draft_tokens"] = spec_t.pop("num_tokens_per_bs")
    try:  # SpecConfig's rules across its fields and the layout, and the draft's own settings, as "spec.<field>: rule"
        spec = SpecConfig(**spec_t)
        spec.check_layout(layout)
        check_draft_config(model, layout, spec)
    except ValueError as e:
        field, _, rule = str(e).partition(": ")
        raise CaseError(path, field, rule.rsplit(", got ", 1)[0], spec_t.get(field.removeprefix("spec."))) from None
    if spec.topk == 1 and spec.num_tokens_per_bs != spec.num_steps + 1:
        # SGLang resets it (speculative_num_draft_tokens = num_steps + 1 when topk == 1, with a warning): a case file
        # holding another value would describe a config no engine runs, so it is refused rather than reset silently
        raise CaseError(path, "spec.num_tokens_per_bs", f"num_steps + 1 ({spec.num_steps + 1}) with topk 1 (a chain of num_steps drafts and "
                        "the root; engines reset any other value), or topk > 1 for a wider tree", spec.num_tokens_per_bs)
    if spec.draft.has_draft_decode and spec.topk * (spec.num_steps - 1) > spec.num_tokens_per_bs:
        raise CaseError(path, "spec.topk", f"topk * (num_steps - 1) <= num_tokens_per_bs ({spec.num_tokens_per_bs}): "
                        f"the {spec.draft.value} draft decode's slots", spec.topk)
    if spec.topk > model.vocab_size:
        raise CaseError(path, "spec.topk", f"at most model.vocab_size ({model.vocab_size})", spec.topk)

    sched_t = data["schedule"]
    _check_table(path, "schedule.", sched_t, _SCHEDULE)
    if "batches" not in sched_t:
        raise CaseError(path, "schedule.batches", "a list of iterations, each a list of per-DP-group batch sizes")
    T = spec.num_tokens_per_bs
    if T + 1 > model.max_context_len:
        raise CaseError(path, "spec.num_tokens_per_bs", f"at most model.max_context_len - 1 ({model.max_context_len - 1})", T)
    max_prefix = sched_t.get("max_prefix_len", min(16, model.max_context_len - T))
    _positive(path, "schedule.max_prefix_len", max_prefix)
    if max_prefix + T > model.max_context_len:
        raise CaseError(path, "schedule.max_prefix_len", f"at most model.max_context_len - num_tokens_per_bs ({model.max_context_len - T})", max_prefix)
    batches = sched_t["batches"]
    if not batches:
        raise CaseError(path, "schedule.batches", "at least one iteration", batches)
    _check_budget(path, model, layout, spec, len(batches))
    dp = layout.attn_dp_size
    schedule = []
    for i, it in enumerate(batches):
        where = f"schedule.batches[{i}]"
        if not isinstance(it, list) or len(it) != dp or not all(_is_int(b) for b in it):
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
    prefix = _explicit_lens(path, sched_t, "prefix_lens", schedule_t, 1, model.max_context_len - T, "a prefix length (seq_len = prefix + num_tokens_per_bs)")
    accept = _explicit_lens(path, sched_t, "accept_lens", schedule_t, 1, T, "an accept length")
    rids = _explicit_lens(path, sched_t, "rids", schedule_t, 0, 2**31 - 1, "a request id")
    if rids is not None:
        for i, it in enumerate(rids):
            flat = [r for group in it for r in group]
            if len(set(flat)) != len(flat):
                raise CaseError(path, f"schedule.rids[{i}]", "distinct request ids within an iteration", it)
    iterations = with_explicit_lens(seeded_requests(seed, schedule_t, T, max_prefix), prefix, accept, rids)
    for i, it in enumerate(iterations):  # what one rank's pools hold (every rank of a DP group holds its requests)
        for j, reqs in enumerate(it.per_dp):
            ps = spec.page_size
            slots = sum(-(-(r.prefix_len + T) // ps) * ps for r in reqs)  # whole pages
            if slots > (MAX_KV_SLOTS_PER_RANK + 1) - ps:  # page 0 holds the padding slot
                raise CaseError(path, f"schedule.batches[{i}][{j}]",
                                f"requests whose prefix + draft tokens fit one rank's KV pool ({MAX_KV_SLOTS_PER_RANK} slots)",
                                f"{len(reqs)} requests needing {slots} slots")
    tolerances = _parse_tolerances(path, data.get("tolerances", {}))
    _positive(path, "schedule.top_logprobs_num", sched_t.get("top_logprobs_num", 0), 0, min(20, model.vocab_size))  # logprobs asked for: a top-k <= 20
    sc = Scenario(model, spec, layout, iterations, seed=seed, attention_backend=backend, name=data["name"])
    return Case(data["name"], data["description"], str(path), sc, schedule_t, tolerances, sched_t.get("top_logprobs_num"))


def _regular_file(path: Path) -> Path:
    """Refuse what is not a regular file before opening it: a FIFO would block the read forever."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise CaseError(path, "<file>", f"a readable case file ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, socket or device)"
        raise CaseError(path, "<file>", "a regular .toml file", _Verbatim(kind))
    if st.st_size > MAX_CASE_BYTES:
        raise CaseError(path, "<file>", f"a case file of at most {MAX_CASE_BYTES} bytes", _Verbatim(f"{st.st_size} bytes"))
    return path


def load_case(path: Path | str, cases_dir: Optional[Path] = None) -> Case:
    """A case by path, or by name from `cases_dir` (default: the shipped cases)."""
    path, cases_dir = Path(path), Path(cases_dir or CASES_DIR)
    if "\0" in str(path):
        raise CaseError(path, "<file>", "a path without NUL characters")
    if not path.exists():
        named = cases_dir / f"{path}.toml"
        if named.exists():
            path = named
        else:
            names = sorted(p.stem for p in cases_dir.glob("*.toml")) if cases_dir.is_dir() else []
            close = difflib.get_close_matches(str(path), names, n=3, cutoff=0.6)
            lister = "harness list" + ("" if cases_dir.resolve() == Path(CASES_DIR).resolve() else f" --cases-dir {cases_dir}")
            hint = f" (did you mean {' or '.join(close)}? `{lister}` shows them)" if close else f" (`{lister}` shows them)"
            raise CaseError(path, "<file>", f"an existing case file or the name of one in {cases_dir}{hint}")
    _regular_file(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CASE_BYTES + 1)
        data = tomllib.loads(raw.decode("utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise CaseError(path, "<toml>", f"valid TOML ({e})") from None
    except RecursionError:
        raise CaseError(path, "<toml>", "TOML nested a few levels deep (cases use at most three)", _Verbatim("nesting too deep to parse")) from None
    except UnicodeDecodeError as e:
        raise CaseError(path, "<file>", f"UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise CaseError(path, "<file>", f"a readable case file ({e.strerror or e})") from None
    return parse_case(data, path)


def default_cases(cases_dir: Optional[Path] = None) -> list[Case]:
    """Every case in `cases_dir` (default: the shipped ones), by name; none for a missing folder (the caller decides)."""
    d = Path(cases_dir or CASES_DIR)
    return [load_case(p) for p in sorted(d.glob("*.toml"))] if d.is_dir() else []
