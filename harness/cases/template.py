"""Writing case files: `harness new-case`, and a failing hypothesis example as a ready case file.

Every file written here is validated by the same loader that reads it (harness/cases/case.py), so
what `harness new-case` writes is a case `harness check` / `harness golden record` accept,
and what `write_failure_case` writes reruns exactly under `harness replay <path>`.
"""
from __future__ import annotations

import json
import math
import os
import re
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional, Sequence

from harness.cases.case import CASES_DIR, Case, CaseError, parse_case
from harness.cases.data import checkout_root
from harness.golden.place import check_writable
from harness.props.tolerances import Tol
from harness.run.scenario import Scenario
from runners.base_cuda_graph_runner import compute_capture_bs
from runners.config import CudaGraphMode, DraftExtendGraph, DraftExtendShape, ModelConfig, PaddingConvention, SpecConfig
from runners.parallel.layout import ParallelLayout

FAILURE_DIR_ENV = "SPECHARNESS_FAILURE_DIR"


def failure_dir() -> Path:
    """Where shrunk failing examples go: $SPECHARNESS_FAILURE_DIR, else out/failures/ of the checkout (git-ignored), or of
    the working directory for an installed package (never beside it in site-packages)."""
    root = checkout_root()
    return Path(os.environ.get(FAILURE_DIR_ENV) or (root if root is not None else Path.cwd()) / "out" / "failures")


# ----------------------------------------------------------------------------------------
# a tiny TOML writer for the case schema (ints, floats, bools, strings, lists, inline tables)
# ----------------------------------------------------------------------------------------


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"TOML case files hold finite numbers, got {v}")
        r = repr(v)
        return r if any(c in r for c in ".eE") else r + ".0"
    if isinstance(v, str):
        # a TOML basic string: JSON's escapes for quotes, backslash and C0 controls, plus DEL; other text as is
        # (ensure_ascii would write astral characters as surrogate pairs, which TOML rejects)
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"no TOML for {type(v).__name__}: {v!r}")


def _layout_table(layout: ParallelLayout) -> dict:
    default = ParallelLayout()
    out = {"tp_size": layout.tp_size}
    for f in fields(ParallelLayout):
        val = getattr(layout, f.name)
        if f.name != "tp_size" and val != getattr(default, f.name) and val is not None:
            out[f.name] = val
    return out


def _model_table(model: Optional[ModelConfig]) -> dict:
    if model is None:
        return {}
    default = ModelConfig()
    return {f.name: getattr(model, f.name) for f in fields(ModelConfig) if f.name != "dtype" and getattr(model, f.name) != getattr(default, f.name)}


def _spec_table(spec: SpecConfig) -> dict:
    out: dict[str, Any] = {"num_steps": spec.num_steps, "topk": spec.topk}
    if spec.num_draft_tokens is not None:
        out["num_tokens_per_bs"] = spec.num_draft_tokens
    out["capture_bs"] = sorted(set(spec.capture_bs))
    out["max_running_requests"] = spec.max_running_requests
    if spec.page_size != 1:
        out["page_size"] = spec.page_size
    if spec.draft != "multi_layer":
        out["draft"] = spec.draft.value
    out.update({k: v for k, v in spec.draft_fields().items() if k != "draft" and v is not None})  # the draft's own settings
    if spec.draft_extend_graph is not DraftExtendGraph.PER_STEP:
        out["draft_extend_graph"] = spec.draft_extend_graph.value
    out.update({flag: True for flag in ("dp_spec_prefill_coordination", "overlap_schedule") if getattr(spec, flag)})
    for key, default in (("padding_convention", PaddingConvention.SGLANG_DUMMY_SLOT), ("draft_extend_shape", DraftExtendShape.FIXED),
                         ("cuda_graph_mode", CudaGraphMode.FULL)):
        if getattr(spec, key) is not default:
            out[key] = getattr(spec, key).value
    return out


def case_toml(
    name: str,
    description: str,
    layout: ParallelLayout,
    spec: SpecConfig,
    batches: Sequence[Sequence[int]],
    seed: int = 0,
    model: Optional[ModelConfig] = None,
    dtype: str = "float32",
    backend: str = "torch",
    max_prefix_len: Optional[int] = None,
    prefix_lens: Optional[list] = None,
    accept_lens: Optional[list] = None,
    rids: Optional[list] = None,
    tolerances: Optional[dict[str, Tol]] = None,
    header: str = "",
    top_logprobs_num: Optional[int] = None,
) -> str:
    """The text of a case file (see cases/*.toml and harness/cases/case.py for the schema)."""
    lines = [f"# {ln}" if ln else "#" for ln in header.strip("\n").splitlines()] if header else []
    lines += [f"name = {toml_value(name)}", f"description = {toml_value(description)}", f"seed = {seed}", f"dtype = {toml_value(dtype)}",
              f"backend = {toml_value(backend)}", ""]

    def table(title: str, items: dict, comments: Optional[dict] = None) -> None:
        if not items:
            return
        lines.append(f"[{title}]")
        for k, v in items.items():
            if comments and k in comments:
                lines.append(f"# {comments[k]}")
            lines.append(f"{k} = {toml_value(v)}")
        lines.append("")

    table("model", _model_table(model))
    table("layout", _layout_table(layout))
    table("spec", _spec_table(spec))
    sched: dict[str, Any] = {"batches": [list(b) for b in batches]}
    if max_prefix_len is not None:
        sched["max_prefix_len"] = max_prefix_len
    for key, val in (("rids", rids), ("prefix_lens", prefix_lens), ("accept_lens", accept_lens), ("top_logprobs_num", top_logprobs_num)):
        if val is not None:
            sched[key] = val
    table("schedule", sched, {
        "batches": "one entry per decode iteration: the raw batch size of each DP group (0 = idle group)",
        "rids": "per iteration, per DP group, per request: explicit values instead of the seeded draw",
    })
    if tolerances:
        golden = {k.split(".", 1)[1]: v for k, v in tolerances.items() if k.startswith("golden.")}
        rest = {k: v for k, v in tolerances.items() if not k.startswith("golden.")}
        tol = lambda t: {"rtol": t.rtol, "atol": t.atol, "reason": t.reason}  # noqa: E731
        table("tolerances", {k: tol(v) for k, v in rest.items()})
        table("tolerances.golden", {k: tol(v) for k, v in golden.items()})
    return "\n".join(lines).rstrip("\n") + "\n"


def validate_text(text: str, path: Path) -> Case:
    """Parse as the loader would; a CaseError names the field."""
    return parse_case(tomllib.loads(text), path)


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------
# harness new-case
# ----------------------------------------------------------------------------------------


def default_batches(layout: ParallelLayout, spec: SpecConfig) -> list[list[int]]:
    """Three iterations that cover what goes wrong: raw_bs below a bucket, a shrink across bucket
    boundaries (stale padded lanes), uneven DP load, and (with DP attention) idle DP groups."""
    top = min(max(compute_capture_bs(layout, spec.capture_bs, spec.max_running_requests)), spec.max_running_requests)
    dp = layout.attn_dp_size
    clamp = lambda b: max(1, min(top, b))  # noqa: E731
    big = [clamp(top - 1 - 2 * j) if top > 2 else clamp(top - j) for j in range(dp)]
    mid = [clamp([3, 1, 2, 1][j % 4]) for j in range(dp)]
    last = [1] + [0] * (dp - 1)
    return [big, mid, last]


def coverage(layout: ParallelLayout, cases: Sequence[Case]) -> list[str]:
    """Shipped cases with the same branch and tp/dp (what a new case adds to)."""
    return [c.name for c in cases if c.layout.branch is layout.branch and c.layout.tp_size == layout.tp_size
            and c.layout.attn_dp_size == layout.attn_dp_size]


def case_file_path(name: str, directory: Optional[Path] = None) -> Path:
    """Where `new_case` writes the case: the errors about it name the same file."""
    return (Path(directory) if directory is not None else CASES_DIR) / f"{name}.toml"


def new_case(
    name: str,
    layout: ParallelLayout,
    spec: Optional[SpecConfig] = None,
    batches: Optional[Sequence[Sequence[int]]] = None,
    description: Optional[str] = None,
    seed: int = 0,
    directory: Optional[Path] = None,
    force: bool = False,
) -> tuple[Path, Case]:
    """Write <directory>/<name>.toml for a parallel config, validated; refuses to overwrite unless force, and to write
    into the installed package (harness.golden.place.check_writable)."""
    path = case_file_path(name, directory)
    check_writable(path.parent, flags="a directory of your own: new_case(directory=DIR), harness new-case --dir DIR")
    spec = spec or SpecConfig(num_steps=3, topk=1, capture_bs=(1, 2, 4, 8), max_running_requests=8)
    if path.exists() and not force:
        raise CaseError(path, "<file>", "a new case name (the file exists; pass --force to overwrite)")
    batches = [list(b) for b in (batches or default_batches(layout, spec))]
    description = description or f"{layout.describe()}: generated by harness new-case"
    text = case_toml(name, description, layout, spec, batches, seed=seed)
    case = validate_text(text, path)
    _write_atomic(path, text)
    return path, case


def parse_batches(text: str) -> list[list[int]]:
    """'3,1 1,2 1,0' (or ';'-separated) -> [[3, 1], [1, 2], [1, 0]]: per iteration, each DP group's raw bs."""
    out = []
    for it in re.split(r"[;\s]+", text.strip()):
        if it:
            try:
                out.append([int(x) for x in it.split(",")])
            except ValueError:
                raise CaseError("--batches", "schedule.batches", "iterations separated by spaces or ';', DP groups by ',' (e.g. '3,1 1,2 1,0')", text) from None
    return out


# ----------------------------------------------------------------------------------------
# a failing hypothesis example -> a ready case file
# ----------------------------------------------------------------------------------------

_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def _show(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def _default_name(prop: Optional[str]) -> str:
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[-1].split(" ")[0]
    base = test or (prop or "example")
    return "failure_" + _SAFE.sub("_", base).strip("_.-")[:80]


def _ctor(obj) -> str:
    """A dataclass as the shortest constructor call that rebuilds it (non-default fields only)."""
    default = type(obj)()
    args = [f"{f.name}={getattr(obj, f.name)!r}" for f in fields(obj) if getattr(obj, f.name) != getattr(default, f.name)]
    return f"{type(obj).__name__}({', '.join(args)})"


def example_snippet(layout: ParallelLayout, spec: SpecConfig, schedule: Sequence[Sequence[int]], seed: Optional[int] = None) -> str:
    args = [f"layout={_ctor(layout)}", f"spec={_ctor(spec)}", f"schedule={[tuple(s) for s in schedule]!r}"]
    if seed:
        args.append(f"seed={seed}")
    return f"@example({', '.join(args)})"


def write_failure_case(
    layout: Optional[ParallelLayout] = None,
    spec: Optional[SpecConfig] = None,
    schedule: Optional[Sequence[Sequence[int]]] = None,
    seed: int = 0,
    *,
    scenario: Optional[Scenario] = None,
    model: Optional[ModelConfig] = None,
    prefix_lens: Optional[list] = None,
    accept_lens: Optional[list] = None,
    prop: Optional[str] = None,
    message: str = "",
    name: Optional[str] = None,
    directory: Optional[Path] = None,
) -> Path:
    """Write a (shrunk) failing example as a case file and return its path.

    Give either layout + spec + schedule (per iteration, each DP group's raw bs; prefix and accept
    lengths drawn from `seed` as for any case, or explicit) or a whole `scenario` (its exact
    requests are written: ids, prefix and accept lengths). The name defaults to
    failure_<test function> (from PYTEST_CURRENT_TEST), so hypothesis' shrink passes overwrite one
    file and the last write, hypothesis' final replay of the minimal example, is what stays.
    The file goes to `directory`, else $SPECHARNESS_FAILURE_DIR, else out/failures/.
    """
    rids = None
    if scenario is not None:
        layout, spec, model, seed = scenario.layout, scenario.spec, scenario.model, scenario.seed
        schedule = [it.dp_batch_sizes for it in scenario.iterations]
        rids = [[[r.rid for r in g] for g in it.per_dp] for it in scenario.iterations]
        prefix_lens = [[[r.prefix_len for r in g] for g in it.per_dp] for it in scenario.iterations]
        accept_lens = [[[r.accept_len for r in g] for g in it.per_dp] for it in scenario.iterations]
    if layout is None or spec is None or schedule is None:
        raise TypeError("write_failure_case needs layout, spec and schedule, or scenario")
    name = name or _default_name(prop)
    path = Path(directory or failure_dir()) / f"{name}.toml"
    dp = layout.attn_dp_size
    batches = [list(s)[:dp] if dp > 1 else list(s)[:1] for s in schedule]
    msg_lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()][:2]
    header = "\n".join([
        f"A failing example{f' of {prop}' if prop else ''}, written by harness.cases.template.write_failure_case.",
        *[f"failure: {ln[:300]}" for ln in msg_lines],
        f"rerun it exactly:  harness replay {_show(path)}",
        "keep it: move it to cases/<name>.toml, set name, describe what broke, then harness golden record <name>",
        "and pin it in the test:",
        "  " + example_snippet(layout, spec, batches, seed),
    ])
    text = case_toml(name, f"failing example{f' ({prop})' if prop else ''}: {layout.describe()}"[:200], layout, spec, batches, seed=seed,
                     model=model if model not in (None, ModelConfig()) else None, dtype=(model.dtype if model else "float32"),
                     prefix_lens=prefix_lens, accept_lens=accept_lens, rids=rids, header=header)
    try:
        validate_text(text, path)
    except CaseError as e:  # still write it: the example is what failed, even where a case file can't hold it
        text = f"# NOTE: not a valid case file as written: {str(e).split(': ', 1)[-1]}\n" + text
    _write_atomic(path, text)
    return path


def failure_note(path: Path, layout: ParallelLayout, spec: SpecConfig, schedule: Sequence[Sequence[int]], seed: int = 0) -> str:
    """The lines a failing property test appends to its failure message."""
    shown = _show(path)
    return "\n".join([
        f"shrunk failing example written as a case file: {shown}",
        f"  rerun it exactly:      harness replay {shown}",
        f"  keep it as a case:     mv {shown} cases/<name>.toml  (set name = \"<name>\" and the description), then harness golden record <name>",
        f"  pin it in the test:    {example_snippet(layout, spec, schedule, seed)}",
    ])
