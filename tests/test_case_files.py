"""Case files: the shipped cases' coverage, the schema's additions, round trips through the writer,
new_case's default schedules, and a fuzz of malformed files (issue 7); the command line's new-case and
failing examples written as cases are in test_case_writers.py.

The fuzz takes valid case files (the shipped ones), breaks each in one way (an unknown key, a
missing required key, a wrong type, a value out of range, a schedule of the wrong shape, a bad
name, broken TOML, non-UTF-8 bytes) and asserts the loader answers with one CaseError naming the
file and the broken field, and that the CLI prints it on one line with exit code 2, no traceback.
"""
from __future__ import annotations

import contextlib
import copy
import io
import itertools
import tempfile
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cases.case import CASES_DIR, CaseError, default_cases, load_case, parse_case
from harness.cases.template import case_toml, default_batches, new_case, toml_value
from harness.cli import main
from runners.base_cuda_graph_runner import compute_capture_bs
from runners.config import SpecConfig
from runners.parallel.layout import Branch, ParallelLayout
from tests.helpers.prewarmed import run_module

SHIPPED = default_cases()
RAW = {p.stem: tomllib.loads(p.read_text()) for p in sorted(CASES_DIR.glob("*.toml"))}


# ----------------------------------------------------------------------------------------
# shipped cases: coverage the issue asks for
# ----------------------------------------------------------------------------------------


def test_shipped_cases_cover_every_branch_and_size():
    layouts_ = [c.layout for c in SHIPPED]
    assert {x.branch for x in layouts_} == set(Branch)
    assert {x.tp_size for x in layouts_} >= {1, 2, 4, 8}
    assert {x.attn_dp_size for x in layouts_} >= {2, 4}
    dp = [x for x in layouts_ if x.enable_dp_attention]
    assert {x.enable_dp_lm_head for x in dp} == {True, False}
    assert {x.enable_dp_lm_head for x in dp if x.attn_dp_size == 4} == {True, False}  # dp4 with dp-lm-head on and off
    for branch in Branch:  # every branch at more than one tp size
        assert len({x.tp_size for x in layouts_ if x.branch is branch}) >= 2, branch


def _crosses_down(case) -> bool:
    """Some iteration replays a smaller bucket than an earlier one: stale padded lanes."""
    spec, layout = case.scenario.spec, case.layout
    buckets = compute_capture_bs(layout, spec.capture_bs, spec.max_running_requests)
    need = [max(b) for b in case.schedule]
    bucket = [min(x for x in buckets if x >= n) for n in need]
    return any(bucket[j] < max(bucket[:j]) for j in range(1, len(bucket)))


def test_shipped_cases_include_shrink_idle_and_explicit_schedules():
    assert any(_crosses_down(c) for c in SHIPPED), "a batch-shrink schedule across bucket boundaries"
    assert any(0 in it for c in SHIPPED for it in c.schedule), "an idle-DP-rank schedule"
    assert any("prefix_lens" in RAW[c.name]["schedule"] for c in SHIPPED), "explicit per-request lengths"
    assert any(c.tolerances for c in SHIPPED), "a [tolerances] table"
    assert any(c.scenario.spec.num_tokens_per_bs != c.scenario.spec.num_steps + 1 for c in SHIPPED)


@pytest.mark.parametrize("case", SHIPPED, ids=lambda c: c.name)
def test_writer_round_trips_every_shipped_case(case, tmp_path):
    sc = case.scenario
    per = lambda f: [[[f(r) for r in g] for g in it.per_dp] for it in sc.iterations]  # noqa: E731
    text = case_toml(case.name, case.description, sc.layout, sc.spec, case.schedule, sc.seed, model=sc.model, dtype=sc.model.dtype,
                     backend=sc.attention_backend, rids=per(lambda r: r.rid), prefix_lens=per(lambda r: r.prefix_len),
                     accept_lens=per(lambda r: r.accept_len), tolerances=case.tolerances, top_logprobs_num=case.top_logprobs_num)
    path = tmp_path / f"{case.name}.toml"
    path.write_text(text)
    again = load_case(path)
    assert again.scenario == sc and again.schedule == case.schedule and again.tolerances == case.tolerances
    assert again.top_logprobs_num == case.top_logprobs_num


def test_explicit_lengths_rids_and_tolerances(tmp_path):
    data = copy.deepcopy(RAW["tp2_neither"])
    data["schedule"]["batches"] = [[2], [1]]
    data["schedule"]["prefix_lens"] = [[[1, 40]], [[7]]]
    data["schedule"]["accept_lens"] = [[[4, 1]], [[2]]]
    data["schedule"]["rids"] = [[[10, 3]], [[10]]]
    data["tolerances"] = {"eager_vs_graph": {"rtol": 1e-6, "atol": 2e-6}, "golden": {"logits": {"rtol": 0.0, "atol": 1e-4, "reason": "why"}}}
    c = parse_case(data, tmp_path / "tp2_neither.toml")
    reqs = [[(r.rid, r.prefix_len, r.accept_len) for r in it.per_dp[0]] for it in c.scenario.iterations]
    assert reqs == [[(10, 1, 4), (3, 40, 1)], [(10, 7, 2)]]
    assert c.tol("eager_vs_graph").atol == 2e-6 and c.tol("golden.logits").reason == "why"
    assert c.tol("golden.hidden") is None and c.tol("cross_layout", "dflt") == "dflt"


# ----------------------------------------------------------------------------------------
# the fuzz: >= 200 malformed case files, each one line naming file and field
# ----------------------------------------------------------------------------------------


def dumps(data: dict) -> str:
    """Any dict as TOML: scalars and inline values first, then one [table] per dict value."""
    head = [f"{k} = {toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    body = []
    for k, v in data.items():
        if isinstance(v, dict):
            body.append(f"[{k}]")
            body += [f"{kk} = {toml_value(vv)}" for kk, vv in v.items()]
    return "\n".join(head + [""] + body) + "\n"


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
BAD_FOR = {  # values a key of this type must refuse
    int: st.one_of(TEXT, st.booleans(), st.floats(-1e6, 1e6).filter(lambda x: x != int(x)), st.lists(st.integers(0, 9), max_size=3)),
    bool: st.one_of(TEXT, st.integers(), st.floats(-10, 10)),
    str: st.one_of(st.integers(), st.booleans(), st.floats(-10, 10), st.lists(st.integers(0, 9), max_size=2)),
    list: st.one_of(st.integers(), TEXT, st.booleans()),
    dict: st.one_of(st.integers(), TEXT, st.lists(st.integers(0, 9), max_size=2)),
    float: st.one_of(TEXT, st.booleans(), st.lists(st.integers(0, 9), max_size=2)),
}
TYPES = {
    "": {"name": str, "description": str, "seed": int, "dtype": str, "backend": str, "layout": dict, "spec": dict, "schedule": dict, "model": dict,
         "tolerances": dict},
    "layout": {"tp_size": int, "dp_size": int, "enable_dp_attention": bool, "moe_dense_tp_size": int, "enable_dp_lm_head": bool,
               "moe_a2a_backend": str, "enable_two_batch_overlap": bool},
    "spec": {"num_steps": int, "topk": int, "num_tokens_per_bs": int, "capture_bs": list, "max_running_requests": int, "draft_extend_graph": str},
    "schedule": {"batches": list, "max_prefix_len": int, "prefix_lens": list, "accept_lens": list, "rids": list},
    "model": {"hidden_size": int, "num_heads": int, "vocab_size": int, "max_context_len": int, "rope_theta": float, "rms_eps": float, "seed": int},
}
OUT_OF_RANGE = [  # (table, key, bad values): the loader must name exactly this field
    ("", "seed", [-1, 2**40]),
    ("layout", "tp_size", [0, 9, 3, -2]),
    ("spec", "num_steps", [0, -1, 1000]),
    ("spec", "topk", [0, 10**6]),
    ("spec", "num_tokens_per_bs", [0, 500]),
    ("spec", "max_running_requests", [0, 10**9]),
    ("spec", "capture_bs", [[], [0], [2, -4], [10**6], ["x"]]),
    ("spec", "draft_extend_graph", ["one", "ONE_GRAPH", ""]),
    ("schedule", "max_prefix_len", [0, -3, 100000]),
    ("model", "hidden_size", [0, 1, 60, 10**7]),
    ("model", "num_heads", [0, 3, 1000]),
    ("model", "vocab_size", [0, 10**8]),
    ("model", "max_context_len", [1, 10**9]),
    ("model", "rms_eps", [0, -1.0]),
    ("", "dtype", ["float64", "fp8", ""]),
    ("", "backend", ["cuda", "", "flash"]),
    ("layout", "moe_a2a_backend", ["nccl", "DeepEP"]),
    ("layout", "moe_dense_tp_size", [0, 3, -1]),
]


@st.composite
def malformed(draw) -> tuple[str, dict | str | bytes, str]:
    """(file stem, data or raw text/bytes, expected field path) for one broken case file."""
    base_name = draw(st.sampled_from(sorted(RAW)))
    data = copy.deepcopy(RAW[base_name])
    stem = base_name
    kind = draw(st.sampled_from(["unknown", "missing", "type", "range", "schedule", "name", "toml", "bytes", "tolerance", "lens"]))
    if kind == "unknown":
        table = draw(st.sampled_from(["", "layout", "spec", "schedule", "model", "tolerances", "tolerances.golden"]))
        key = draw(st.sampled_from(["tp", "dp_sise", "bogus", "num_step", "extra", "Name", "batch"]))
        if table == "":
            data[key] = 1
            return stem, data, key
        if table == "tolerances.golden":
            data.setdefault("tolerances", {}).setdefault("golden", {})[key] = {"rtol": 0, "atol": 0}
            return stem, data, f"tolerances.golden.{key}"
        data.setdefault(table, {})[key] = 1
        return stem, data, f"{table}.{key}"
    if kind == "missing":
        where = draw(st.sampled_from(["name", "description", "layout", "schedule", "layout.tp_size", "schedule.batches"]))
        table, _, key = where.rpartition(".")
        (data[table] if table else data).pop(key)
        if key == "layout":  # without a layout there is no tp_size either: the table is what's missing
            return stem, data, "layout"
        return stem, data, where
    if kind == "type":
        table = draw(st.sampled_from(sorted(TYPES)))
        key = draw(st.sampled_from(sorted(TYPES[table])))
        bad = draw(BAD_FOR[TYPES[table][key]])
        target = data if table == "" else data.setdefault(table, {})
        target[key] = bad
        if table == "" and key == "name" and isinstance(bad, str):
            return stem, data, "name"
        return stem, data, key if table == "" else f"{table}.{key}"
    if kind == "range":
        table, key, values = draw(st.sampled_from(OUT_OF_RANGE))
        target = data if table == "" else data.setdefault(table, {})
        target[key] = draw(st.sampled_from(values))
        if key == "tp_size" and data["layout"].get("dp_size", 1) > 1:  # e.g. tp 3 with dp 2: the rule names dp_size
            return stem, data, "layout.tp_size|layout.dp_size"
        if key in ("hidden_size", "num_heads"):  # hidden_size % num_heads: a rule between the two fields
            return stem, data, "model.hidden_size|model.num_heads|model.num_kv_heads"
        return stem, data, key if table == "" else f"{table}.{key}"
    if kind == "schedule":
        batches = data["schedule"]["batches"]
        dp = len(batches[0])
        i = draw(st.integers(0, len(batches) - 1))
        how = draw(st.sampled_from(["empty", "groups", "negative", "idle", "too_big", "not_list"]))
        if how == "empty":
            data["schedule"]["batches"] = []
            return stem, data, "schedule.batches"
        if how == "groups":
            batches[i] = batches[i] + [1]
            return stem, data, f"schedule.batches[{i}]"
        if how == "negative":
            batches[i][0] = -draw(st.integers(1, 5))
            return stem, data, f"schedule.batches[{i}][0]"
        if how == "idle":
            batches[i] = [0] * dp
            return stem, data, f"schedule.batches[{i}]" if dp > 1 else f"schedule.batches[{i}]"
        if how == "too_big":
            batches[i][-1] = 10_000
            return stem, data, f"schedule.batches[{i}][{dp - 1}]"
        batches[i] = draw(st.sampled_from([5, "3", True]))
        return stem, data, f"schedule.batches[{i}]"
    if kind == "lens":
        key = draw(st.sampled_from(["prefix_lens", "accept_lens", "rids"]))
        sizes = data["schedule"]["batches"]
        good = [[[1] * b for b in it] for it in sizes]
        how = draw(st.sampled_from(["iterations", "groups", "requests", "value"]))
        if how == "iterations":
            data["schedule"][key] = good + [[[1]]]
            return stem, data, f"schedule.{key}"
        if how == "groups":
            good[0] = good[0] + [[1]]
            data["schedule"][key] = good
            return stem, data, f"schedule.{key}[0]"
        if how == "requests":
            good[0][0] = good[0][0] + [1]
            data["schedule"][key] = good
            return stem, data, f"schedule.{key}[0][0]"
        j = next(j for j, b in enumerate(sizes[0]) if b > 0)
        good[0][j][0] = {"prefix_lens": 0, "accept_lens": 99, "rids": -1}[key]
        data["schedule"][key] = good
        return stem, data, f"schedule.{key}[0][{j}][0]"
    if kind == "tolerance":
        which = draw(st.sampled_from(["eager_vs_graph", "cross_layout", "golden.logits", "golden.hidden"]))
        part = draw(st.sampled_from(["rtol", "atol", "reason", "missing", "not_table"]))
        tol: object = {"rtol": 1e-5, "atol": 1e-5}
        expect = f"tolerances.{which}.{part}"
        if part == "rtol":
            tol["rtol"] = draw(st.sampled_from([-1.0, "1e-5", True]))
        elif part == "atol":
            tol["atol"] = draw(st.sampled_from([-1e-3, [1]]))
        elif part == "reason":
            tol["reason"] = 5
        elif part == "missing":
            tol.pop(draw(st.sampled_from(["rtol", "atol"])))
            expect = None  # either part
        else:
            tol, expect = 1e-5, f"tolerances.{which}"
        t = data.setdefault("tolerances", {})
        if which.startswith("golden."):
            t.setdefault("golden", {})[which.split(".")[1]] = tol
        else:
            t[which] = tol
        return stem, data, expect or f"tolerances.{which}.*"
    if kind == "name":
        how = draw(st.sampled_from(["mismatch", "bad_chars"]))
        if how == "mismatch":
            stem = base_name + "_copy"
        else:
            data["name"] = draw(st.sampled_from(["../evil", "a b", "", "-x", "x/y"]))
        return stem, data, "name"
    if kind == "toml":
        text = dumps(data)
        lines = text.splitlines()
        k = draw(st.integers(0, len(lines)))
        junk = draw(st.sampled_from(["= =", "[layout", "name = \"a\"\nname = \"b\"", "x = [1, 2", "'unterminated", "[[spec]]\ny=1", "a.b.c = = 3"]))
        lines.insert(k, junk)
        return stem, "\n".join(lines), "<toml>"
    raw = dumps(data).encode()
    k = draw(st.integers(0, len(raw)))
    return stem, raw[:k] + b"\xff\xfe\x80" + raw[k:], "<file>"


def _check_one(stem: str, content, expected: str, directory: Path) -> None:
    path = directory / f"{stem}.toml"
    if isinstance(content, dict):
        path.write_text(dumps(content), encoding="utf-8")
    elif isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    else:
        path.write_bytes(content)
    with pytest.raises(CaseError) as info:
        load_case(path)
    e = info.value
    msg = str(e)
    assert "\n" not in msg, msg
    assert msg.startswith(f"{path}: "), msg
    if expected.endswith(".*"):
        assert e.field.startswith(expected[:-1]), (expected, msg)
    elif "|" in expected:
        assert e.field in expected.split("|"), (expected, msg)
    else:
        assert e.field == expected, (expected, msg)
    assert f": {e.field}: expected " in msg
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["list", str(path)])
    out = err.getvalue()
    assert rc == 2 and out.count("\n") == 1 and out.startswith(f"error: {path}: {e.field}: ") and "Traceback" not in out, out


def test_fuzz_malformed_case_files_get_one_line_naming_file_and_field():
    seen: list[str] = []
    counter = itertools.count()
    with tempfile.TemporaryDirectory() as d:

        @settings(max_examples=300, derandomize=True, database=None, deadline=None)
        @given(malformed())
        def one(example):
            stem, content, expected = example
            sub = Path(d) / str(next(counter))
            sub.mkdir()
            _check_one(stem, content, expected, sub)
            seen.append(expected)

        one()
    assert len(seen) >= 200, f"only {len(seen)} malformed files generated"
    assert len({f.split("[")[0] for f in seen}) >= 30  # spread over many fields, not one


@pytest.mark.parametrize("content,field", [
    ({"name": "x", "description": "d", "layout": {"tp_size": 4, "dp_size": 3, "enable_dp_attention": True}, "schedule": {"batches": [[1]]}},
     "layout.dp_size"),
    ("name = 'x'\n[layout\n", "<toml>"),
    ({"name": "x", "description": "d", "layout": {"tp_size": 2}, "schedule": {"batches": [[1]]}, "colour": "red"}, "colour"),
])
def test_cli_prints_one_line_and_exits_2_in_a_fresh_process(content, field, tmp_path):
    path = tmp_path / "x.toml"
    path.write_text(content if isinstance(content, str) else dumps(content))
    p = run_module("harness.cli", "check", str(path), timeout=120)  # a process of its own, forked from tests/helpers/prewarmed.py's server
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith(f"error: {path}: {field}: expected ") and "Traceback" not in p.stderr, p.stderr


def test_a_directory_or_missing_file_is_a_case_error(tmp_path):
    (tmp_path / "d.toml").mkdir()
    with pytest.raises(CaseError, match="<file>"):
        load_case(tmp_path / "d.toml")
    with pytest.raises(CaseError, match="an existing case file"):
        load_case(tmp_path / "nope.toml")


# ----------------------------------------------------------------------------------------
# harness new-case
# ----------------------------------------------------------------------------------------


def test_new_case_writes_a_valid_case_with_a_useful_default_schedule(tmp_path):
    layout = ParallelLayout(8, 4, True, 1, True, "deepep")
    path, case = new_case("tp8_dp4_x", layout, directory=tmp_path)
    assert path == tmp_path / "tp8_dp4_x.toml" and load_case(path).scenario == case.scenario
    assert case.layout.branch is Branch.ATTN_TP_GATHER
    assert _crosses_down(case) and 0 in case.schedule[-1]
    with pytest.raises(CaseError, match="exists"):
        new_case("tp8_dp4_x", layout, directory=tmp_path)


@pytest.mark.parametrize("layout", [ParallelLayout(1), ParallelLayout(2, 2, True), ParallelLayout(8, 8, True, 1, True, "deepep")], ids=str)
def test_default_batches_are_valid_for_any_layout(layout, tmp_path):
    spec = SpecConfig(capture_bs=(1, 2, 4, 8), max_running_requests=8)
    assert len(default_batches(layout, spec)) == 3
    new_case("c", layout, spec, directory=tmp_path)
