"""Malformed case files and goldens through the CLI: one line naming the file and the field, exit 2,
no traceback, no hang; the resource budget names its estimate.

Hundreds of files are generated from a valid case and a valid golden, one mistake each, and run
in-process through harness.cli.main (fast); a few go through `python -m harness.cli` in a process of
its own (tests/helpers/prewarmed.py).
"""
from __future__ import annotations

import copy
import io
import json
import os
import re
import shutil
import tomllib
import zipfile
from pathlib import Path

import numpy as np
import pytest

from harness.cases.budget import MAX_ITERATIONS, estimate_bytes, memory_budget_bytes
from harness.cases.case import CASES_DIR, load_case
from harness.cases.template import toml_value
from harness.cli import main
from harness.golden import GOLDEN_DIR, npz_bytes
from tests.helpers.prewarmed import run_module

BASE_CASE = "tp2_dp2_mlp_tp_gather"
BASE = tomllib.loads((CASES_DIR / f"{BASE_CASE}.toml").read_text())
GOLDEN_CASE = "tp1_neither"
ERROR_LINE = re.compile(r"^error: .+: (<[a-z ]+>|[A-Za-z_][\w.\[\]]*): expected ")  # file: field: expected ...


def toml_text(doc: dict) -> str:
    lines = [f"{k} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for k, v in doc.items():
        if isinstance(v, dict):
            lines.append(f"[{k}]")
            lines += [f"{kk} = {toml_value(vv)}" for kk, vv in v.items()]
    return "\n".join(lines) + "\n"


def with_value(path: tuple, value) -> dict:
    doc = copy.deepcopy(BASE)
    d = doc
    for k in path[:-1]:
        d = d.setdefault(k, {})
    if value is _DELETE:
        del d[path[-1]]
    else:
        d[path[-1]] = value
    return doc


_DELETE = object()
# every field of the case schema with a valid value's type; the wrong values below are of other types
FIELDS = {
    ("name",): "s", ("description",): "s", ("seed",): "i", ("dtype",): "s", ("backend",): "s",
    ("layout", "tp_size"): "i", ("layout", "dp_size"): "i", ("layout", "enable_dp_attention"): "b", ("layout", "moe_dense_tp_size"): "i",
    ("layout", "enable_dp_lm_head"): "b", ("layout", "moe_a2a_backend"): "s", ("layout", "enable_two_batch_overlap"): "b",
    ("spec", "num_steps"): "i", ("spec", "topk"): "i", ("spec", "num_tokens_per_bs"): "i", ("spec", "capture_bs"): "l",
    ("spec", "max_running_requests"): "i",
    ("model", "hidden_size"): "i", ("model", "num_heads"): "i", ("model", "num_kv_heads"): "i", ("model", "intermediate_size"): "i",
    ("model", "vocab_size"): "i", ("model", "num_target_layers"): "i", ("model", "max_context_len"): "i", ("model", "rope_theta"): "f",
    ("model", "rms_eps"): "f", ("model", "seed"): "i",
    ("schedule", "batches"): "l", ("schedule", "max_prefix_len"): "i", ("schedule", "prefix_lens"): "l", ("schedule", "accept_lens"): "l",
    ("schedule", "rids"): "l", ("tolerances", "eager_vs_graph"): "t", ("tolerances", "cross_layout"): "t", ("tolerances", "golden"): "t",
}
WRONG = {"s": [1, True, [1], {"a": 1}], "i": ["3", 2.5, True, [1], {"a": 1}], "b": [1, "yes", [True]], "f": ["1e-6", [1.0], True],
         "l": ["1,2", 3, {"a": 1}, [[["deep"]]]], "t": ["x", 1, [1]]}
OUT_OF_RANGE = [
    (("seed",), -1), (("seed",), 2**62), (("layout", "tp_size"), 0), (("layout", "tp_size"), 3), (("layout", "tp_size"), 12),
    (("layout", "tp_size"), 256), (("layout", "dp_size"), 3),
    (("layout", "dp_size"), 0), (("layout", "moe_a2a_backend"), "nccl"), (("dtype",), "float64"),
    (("backend",), "cuda"), (("name",), "../escape"), (("name",), "other_name"), (("name",), ""),
    (("spec", "num_steps"), 0), (("spec", "num_steps"), 10_000), (("spec", "topk"), 0), (("spec", "topk"), 100_000), (("spec", "capture_bs"), []),
    (("spec", "capture_bs"), [0]), (("spec", "capture_bs"), [1, 2**40]), (("spec", "max_running_requests"), 0), (("spec", "max_running_requests"), 10**6),
    (("spec", "num_tokens_per_bs"), 0), (("model", "hidden_size"), 0), (("model", "hidden_size"), 63), (("model", "num_heads"), 3),
    (("model", "num_kv_heads"), 3), (("model", "vocab_size"), 1), (("model", "max_context_len"), 1), (("model", "rope_theta"), 0.0),
    (("model", "rms_eps"), -1.0), (("model", "num_target_layers"), 0),
    (("schedule", "batches"), []), (("schedule", "batches"), [[1]]), (("schedule", "batches"), [[0, 0]]), (("schedule", "batches"), [[-1, 1]]),
    (("schedule", "batches"), [[100, 1]]), (("schedule", "batches"), [[1, 1]] * (MAX_ITERATIONS + 1)), (("schedule", "batches"), [[1, 1]] * 20_000),
    (("schedule", "max_prefix_len"), 0), (("schedule", "max_prefix_len"), 10_000), (("schedule", "prefix_lens"), [[[1], [1]]]),
    (("schedule", "accept_lens"), [[[99] * 7, [1] * 5], [[1] * 3, [1]], [[1], []]]), (("schedule", "rids"), [[[1] * 7, [1] * 5], [[1] * 3, [1]], [[1], []]]),
    (("tolerances", "eager_vs_graph"), {"rtol": -1.0, "atol": 0.0}), (("tolerances", "cross_layout"), {"rtol": 1.0}),
    (("tolerances", "golden"), {"logits": {"rtol": 1.0, "atol": 1.0, "typo": 1}}), (("tolerances", "golden"), {"nope": {"rtol": 1.0, "atol": 1.0}}),
]
BUDGET = [  # the resource budget: each is within the per-field ranges, but the whole would not fit
    {"hidden_size": 4096, "num_heads": 64, "num_kv_heads": 64, "intermediate_size": 16384, "vocab_size": 65536, "max_context_len": 4096},
    {"hidden_size": 4096, "num_heads": 32, "num_kv_heads": 8, "vocab_size": 65536},
    {"hidden_size": 2048, "num_heads": 16, "num_kv_heads": 16, "intermediate_size": 16384, "num_target_layers": 16},
]
RAW = {  # files that are not TOML a loader can read
    "deep_arrays": "name = " + "[" * 5000 + "]" * 5000 + "\n",
    "deep_tables": "x = " + "{a = " * 3000 + "1" + "}" * 3000 + "\n",
    "not_toml": "this is not = = toml\n",
    "unterminated": 'name = "tp\n',
    "empty": "",
    "nul": "name = \"a\x00b\"\n",
    "duplicate_key": 'name = "a"\nname = "b"\n',
    "top_array": "[[layout]]\ntp_size = 1\n",
    "binary": None,  # bytes below
    "latin1": None,
    "huge": "# " + "x" * (1 << 20) + "\n",
}


def generated_cases(tmp: Path) -> list[Path]:
    paths: list[Path] = []

    def write(stem: str, text: str | bytes) -> None:
        p = tmp / f"{stem}.toml"
        (p.write_bytes if isinstance(text, bytes) else p.write_text)(text)
        paths.append(p)

    def doc_named(doc: dict, stem: str) -> dict:
        if doc.get("name") == BASE_CASE:
            doc["name"] = stem
        return doc

    n = 0
    for path, kind in FIELDS.items():
        for bad in WRONG[kind]:
            n += 1
            write(f"wrong{n}", toml_text(doc_named(with_value(path, bad), f"wrong{n}")))
    for i, table in enumerate(("", "layout", "spec", "model", "schedule", "tolerances")):
        write(f"unknown{i}", toml_text(doc_named(with_value((table, "tp_szie") if table else ("tp_szie",), 1), f"unknown{i}")))
    for i, key in enumerate(("name", "description", "layout", "schedule")):
        doc = with_value((key,), _DELETE)
        write(f"missing{i}", toml_text(doc_named(doc, f"missing{i}") if key != "name" else doc))
    write("missing_tp", toml_text(doc_named(with_value(("layout", "tp_size"), _DELETE), "missing_tp")))
    write("missing_batches", toml_text(doc_named(with_value(("schedule", "batches"), _DELETE), "missing_batches")))
    for i, (path, bad) in enumerate(OUT_OF_RANGE):
        write(f"range{i}", toml_text(doc_named(with_value(path, bad), f"range{i}")))
    for i, model in enumerate(BUDGET):
        write(f"budget{i}", toml_text(doc_named(with_value(("model",), model), f"budget{i}")))
    for stem, text in RAW.items():
        write(stem, text if text is not None else {"binary": bytes(range(256)), "latin1": "name = \"caf\xe9\"\n".encode("latin-1")}[stem])
    return paths


def assert_one_line_error(rc: int, out: str, err: str, path: Path, json_mode: bool) -> None:
    assert rc == 2, (path.name, rc, err[-500:])
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and ERROR_LINE.match(lines[0]), (path.name, err)
    assert str(path) in lines[0], (path.name, lines[0])
    if json_mode:
        doc = json.loads(out)
        assert doc["exit_code"] == 2 and doc["error"]["kind"] == "bad-input" and doc["error"]["message"] == lines[0][len("error: "):]


def test_generated_malformed_case_files(tmp_path, capsys):
    paths = generated_cases(tmp_path)
    assert len(paths) >= 150
    for i, path in enumerate(paths):
        json_mode = i % 2 == 0
        rc = main(["list", str(path), *(["--json"] if json_mode else [])])
        cap = capsys.readouterr()
        assert_one_line_error(rc, cap.out, cap.err, path, json_mode)


def test_budget_errors_state_the_estimate(tmp_path, capsys):
    path = tmp_path / "big.toml"
    path.write_text(toml_text(with_value(("model",), BUDGET[0]) | {"name": "big"}))
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "model: expected a model whose weights and KV pools fit the memory budget of 4 GiB" in err
    assert re.search(r"got an estimate of [\d.]+ GiB for hidden_size 4096", err)
    path.write_text(toml_text(with_value(("schedule", "batches"), [[1, 1]] * 20_000) | {"name": "big"}))
    assert main(["check", str(path)]) == 2
    assert f"schedule.batches: expected at most {MAX_ITERATIONS} iterations (the resource budget), got 20000 iterations" in capsys.readouterr().err


def test_budget_admits_every_shipped_case_and_scales_with_the_world():
    for path in sorted(CASES_DIR.glob("*.toml")):
        case = load_case(path)
        assert estimate_bytes(case.scenario.model, case.layout, case.scenario.spec) < memory_budget_bytes() / 10, path.name
    small, big = (load_case(CASES_DIR / f"{n}.toml") for n in ("tp1_neither", "tp8_neither"))
    small_bytes = estimate_bytes(small.scenario.model, small.layout, small.scenario.spec)
    assert estimate_bytes(big.scenario.model, big.layout, big.scenario.spec) == 17 * small_bytes // 3


def test_budget_follows_the_environment(tmp_path, monkeypatch, capsys):
    path = tmp_path / "mid.toml"
    path.write_text(toml_text(with_value(("model",), BUDGET[2]) | {"name": "mid"}))
    assert main(["list", str(path)]) == 2
    capsys.readouterr()
    monkeypatch.setenv("SPECHARNESS_MEMORY_BUDGET_GIB", "1000")
    assert main(["list", str(path)]) == 0


# ---------------------------------------------------------------------------------------
# goldens
# ---------------------------------------------------------------------------------------


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def generated_goldens(tmp: Path) -> list[tuple[Path, str]]:
    """(golden dir, the file the error must name) per malformed golden of GOLDEN_CASE."""
    meta = json.loads((GOLDEN_DIR / f"{GOLDEN_CASE}.json").read_text())
    npz = (GOLDEN_DIR / f"{GOLDEN_CASE}.npz").read_bytes()
    with np.load(io.BytesIO(npz)) as z:
        arrays = {k: z[k] for k in z.files}
    out: list[tuple[Path, str]] = []

    def write(json_text: str | bytes, npz_data: bytes = npz, bad: str = "json") -> None:
        d = tmp / f"g{len(out)}"
        d.mkdir()
        (d / f"{GOLDEN_CASE}.npz").write_bytes(npz_data)
        (d / f"{GOLDEN_CASE}.json").write_bytes(json_text.encode() if isinstance(json_text, str) else json_text)
        out.append((d, str(d / f"{GOLDEN_CASE}.{bad}")))

    for top in ("[]", "null", '"a string"', "1", "true", "[" * 100_000 + "]" * 100_000, "{", "not json", b"\xff\xfe{}"):
        write(top)
    for key in ("format", "npz_sha256", "aliases", "versions", "config", "tolerances", "model_fingerprint", "config_hash"):
        for bad in ([1], 1, None, {"a": 1} if key not in ("aliases", "versions", "config", "tolerances") else "text"):
            write(json.dumps(dict(meta, **{key: bad})))
    for bad in ({"r0.i0.s1.meta": 1}, {"r0.i0.s1.meta": "no.such.key"}, {"x": None}):
        write(json.dumps(dict(meta, aliases=bad)))
    for bad in ({"torch": 2}, {"torch": None}, {"numpy": ["1"]}):
        write(json.dumps(dict(meta, versions=bad)))

    def with_npz(data: bytes) -> None:
        write(json.dumps(dict(meta, npz_sha256=_sha(data))), data, bad="npz")

    key = next(k for k in sorted(arrays) if k.endswith(".logits"))
    meta_key = next(k for k in sorted(arrays) if k.endswith(".meta"))
    for replacement in (np.array([{"a": 1}], dtype=object), np.array(["text"]), np.zeros(2, dtype=[("a", "i4")]), np.zeros(2, dtype=complex)):
        buf = io.BytesIO()
        np.savez(buf, **dict(arrays, **{key: replacement}))
        with_npz(buf.getvalue())
    for replacement in (np.zeros(3, dtype=np.float32), np.zeros((2, 2), dtype=np.int64)):
        with_npz(npz_bytes(dict(arrays, **{meta_key: replacement})))
    with_npz(b"not a zip at all")
    with_npz(npz[: len(npz) // 2])
    zbuf = io.BytesIO()
    with zipfile.ZipFile(zbuf, "w") as zf:
        zf.writestr("x.npy", b"\x93NUMPY garbage")
    with_npz(zbuf.getvalue())
    return out


def test_generated_malformed_goldens(tmp_path, capsys):
    cases = generated_goldens(tmp_path)
    assert len(cases) >= 50
    for i, (d, named) in enumerate(cases):
        json_mode = i % 2 == 1
        rc = main(["golden", "check", GOLDEN_CASE, "--golden-dir", str(d), *(["--json"] if json_mode else [])])
        cap = capsys.readouterr()
        assert_one_line_error(rc, cap.out, cap.err, Path(named), json_mode)


def test_at_least_200_malformed_inputs(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "g").mkdir()
    assert len(generated_cases(tmp_path / "c")) + len(generated_goldens(tmp_path / "g")) >= 200


# ---------------------------------------------------------------------------------------
# paths that are not regular files: refused before any read, so nothing can hang
# ---------------------------------------------------------------------------------------


def harness_proc(*args: str, cwd: Path | None = None):
    """`python -m harness.cli` in a process of its own (tests/helpers/prewarmed.py); a read that blocks is a timeout, not a hang."""
    p = run_module("harness.cli", *args, cwd=cwd or Path.cwd(), timeout=120)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_fifo_directory_and_device_are_refused_without_hanging(tmp_path):
    fifo = tmp_path / "case.toml"
    os.mkfifo(fifo)
    rc, out, err = harness_proc("check", str(fifo), "--json")  # reading the FIFO would block forever: the timeout catches a regression
    assert_one_line_error(rc, out, err, fifo, True)
    assert "not a regular file" in err
    d = tmp_path / "dir.toml"
    d.mkdir()
    rc, out, err = harness_proc("list", str(d))
    assert_one_line_error(rc, out, err, d, False)
    assert "a directory" in err
    g = tmp_path / "golden"
    g.mkdir()
    shutil.copy(GOLDEN_DIR / f"{GOLDEN_CASE}.npz", g)
    os.mkfifo(g / f"{GOLDEN_CASE}.json")
    rc, out, err = harness_proc("golden", "check", GOLDEN_CASE, "--golden-dir", str(g), "--json")
    assert_one_line_error(rc, out, err, g / f"{GOLDEN_CASE}.json", True)


def test_malformed_inputs_through_a_real_process(tmp_path):
    paths = generated_cases(tmp_path)
    for path in (paths[0], next(p for p in paths if p.stem == "deep_tables"), next(p for p in paths if p.stem == "budget0")):
        rc, out, err = harness_proc("check", str(path), "--json")
        assert_one_line_error(rc, out, err, path, True)


# ---------------------------------------------------------------------------------------
# the JSON Schema for editors, generated from the loader's tables
# ---------------------------------------------------------------------------------------

_TYPES = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool), "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool), "array": lambda v: isinstance(v, list),
          "object": lambda v: isinstance(v, dict)}


def schema_errors(s: dict, v, where: str = "") -> list[str]:
    """The subset of JSON Schema the case schema uses (no jsonschema package in the venv)."""
    if "type" in s and not _TYPES[s["type"]](v):
        return [f"{where}: not {s['type']}"]
    errs = []
    if "enum" in s and v not in s["enum"]:
        errs.append(f"{where}: not in enum")
    if "pattern" in s and not re.fullmatch(s["pattern"].strip("^$"), v):
        errs.append(f"{where}: pattern")
    for key, bad in (("minimum", lambda lim: v < lim), ("maximum", lambda lim: v > lim), ("exclusiveMinimum", lambda lim: v <= lim)):
        if key in s and bad(s[key]):
            errs.append(f"{where}: {key}")
    if isinstance(v, list):
        if len(v) < s.get("minItems", 0) or len(v) > s.get("maxItems", len(v)):
            errs.append(f"{where}: items count")
        for i, x in enumerate(v):
            errs += schema_errors(s.get("items", {}), x, f"{where}[{i}]")
    if isinstance(v, dict):
        errs += [f"{where}.{k}: required" for k in s.get("required", []) if k not in v]
        for k, x in v.items():
            if k in s.get("properties", {}):
                errs += schema_errors(s["properties"][k], x, f"{where}.{k}")
            elif s.get("additionalProperties") is False:
                errs.append(f"{where}.{k}: unknown")
    return errs


def test_case_schema_command_accepts_every_shipped_case_and_rejects_type_and_key_mistakes(tmp_path, capsys):
    assert main(["case-schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["$schema"].endswith("2020-12/schema") and schema["additionalProperties"] is False
    for path in sorted(CASES_DIR.glob("*.toml")):
        assert schema_errors(schema, tomllib.loads(path.read_text())) == [], path.name
    rejected = 0
    for path in generated_cases(tmp_path):
        if path.stem.startswith(("wrong", "unknown", "missing")):
            doc = tomllib.loads(path.read_text())
            assert schema_errors(schema, doc), path.name  # the loader refuses it (test above): so must the schema
            rejected += 1
    assert rejected > 100
    assert schema_errors(schema, with_value(("schedule", "batches"), [[1, 1]] * 20_000))  # the iteration budget
    assert schema_errors(schema, with_value(("model", "hidden_size"), 8192))
