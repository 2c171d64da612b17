"""What engine-check needs from no engine at all: the baseline file, the path plan, the interpreter's bounds check, and the
child process that a crash cannot take the report with (harness/engines/baseline.py, sglang/paths.py, interpreter.py,
isolate.py). The engine-driven sides of each are in tests/test_engine_check.py and tests/test_engine_planted.py."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import textwrap

import numpy as np
import pytest
import torch

from harness.engines.baseline import Baseline, BaselineError, Finding
from harness.engines.options import ALL_PATHS, FillPath, Selection
from harness.engines.report import EngineReport, Line
from harness.engines.sglang.paths import FillPlan
from harness.verdict import Failure
from runners.parallel.layout import ParallelLayout
from tests.helpers.prewarmed import run_python

FMT = "specharness-engine-check-baseline/1"
STALE = {"prop": "P1", "check": "stale slot", "field": "out_cache_loc", "runner": "multi_layer", "step": 0, "branch": "neither", "path": "npu"}


# ---- the file ----


@pytest.mark.parametrize(("text", "names"), [
    ("{not json", "not JSON"),
    ('["a list"]', "the top level must be an object"),
    (json.dumps({"format": "v0", "engine": "sglang", "findings": []}), "format: expected 'specharness-engine-check-baseline/1'"),
    (json.dumps({"format": FMT, "findings": []}), "engine: expected the engine's name"),
    (json.dumps({"format": FMT, "engine": "sglang", "findings": {}}), "findings: expected a list of findings, got dict"),
    (json.dumps({"format": FMT, "engine": "sglang", "findings": [], "extra": 1}), "extra: not a field of a baseline"),
    (json.dumps({"format": FMT, "engine": "sglang", "findings": [{**STALE, "check": ""}]}), "findings[0].check: expected a non-empty string"),
    (json.dumps({"format": FMT, "engine": "sglang", "findings": [STALE, {**STALE, "lane": 4}]}),
     "findings[1].lane: not part of a finding's identity"),
    (json.dumps({"format": FMT, "engine": "sglang", "findings": [{**STALE, "step": [0]}]}), "findings[0].step: expected a string or an integer"),
    (json.dumps({"format": FMT, "engine": "sglang", "findings": [STALE, dict(reversed(STALE.items()))]}),
     "findings[1]: the same finding as an earlier entry"),
])
def test_a_bad_baseline_file_names_the_file_and_the_field(tmp_path, text, names):
    path = tmp_path / "known.json"
    path.write_text(text)
    with pytest.raises(BaselineError) as e:
        Baseline.load(path)
    assert str(e.value).startswith(f"{path}: ") and names in str(e.value), str(e.value)


def test_the_command_ends_2_on_a_bad_baseline_before_loading_an_engine(tmp_path):
    """Exit 2 with the harness's error document, for a file it cannot use and for one written for another engine."""
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": FMT, "engine": "sglang", "findings": [{**STALE, "bucket": 4}]}))
    other = tmp_path / "vllm.json"
    other.write_text(json.dumps({"format": FMT, "engine": "vllm", "findings": []}))
    for path, message in ((bad, f"{bad}: findings[0].bucket: not part of a finding's identity"),
                          (other, f"{other}: engine: written for vllm, this run checks sglang"),
                          (tmp_path / "missing.json", f"{tmp_path / 'missing.json'}: cannot read it")):
        rc, out, err = _main("--engine", "sglang", "--target", str(tmp_path / "nowhere"), "--baseline", str(path), "--json")
        doc = json.loads(out)
        assert rc == 2 and doc["exit_code"] == 2 and message in doc["error"]["message"], (rc, doc)


def test_findings_are_known_new_stale_or_not_checked():
    """Hand-made lines: the run finds A (in the file) and B (not); the file also holds C, on a line the run checked, and D,
    on the NPU path the run did not check."""
    plain, dp2 = ParallelLayout(4), ParallelLayout(4, 2, True)
    a = Failure("P1", "stale slot", "out_cache_loc", {"iteration": 3, "lane": 5, "path": "gpu"}, 0, 350)
    b = Failure("P1", "I1", "global_num_tokens_gpu", {"iteration": 1}, [8], [2])
    gpu = Line("multi_layer", 0, plain, 4, "gpu")
    gpu.verdict.failures += [a, Failure("P1", "stale slot", "out_cache_loc", {"iteration": 9, "lane": 6}, 0, 561)]  # A again
    single = Line("single_layer", 0, dp2, 2)
    single.verdict.failures.append(b)
    rep = EngineReport("sglang", "0.5.23", "prepare", "/x", [gpu, single, Line("multi_layer", 1, plain, 4, "gpu")], [])
    known = {"prop": "P1", "check": "stale slot", "field": "out_cache_loc", "runner": "multi_layer", "step": 0, "branch": "neither",
             "path": "gpu"}
    stale = {"prop": "P1", "check": "canonical", "field": "seq_lens", "runner": "multi_layer", "step": 1, "branch": "neither", "path": "gpu"}
    unchecked = {**known, "path": "npu"}
    base = Baseline("sglang", {_finding(known): "", _finding(stale): "", _finding(unchecked): "tracked upstream"})
    got = rep.classify(base, "known.json")
    assert [f.to_json() for f in got.new] == [{"prop": "P1", "check": "I1", "field": "global_num_tokens_gpu", "runner": "single_layer",
                                               "step": 0, "branch": "mlp_tp_gather"}]
    assert [f.to_json() for f in got.stale] == [stale] and [f.to_json() for f in got.not_checked] == [unchecked]
    assert rep.exit_code() == 1 and [rep.status(ln) for ln in rep.lines] == ["known", "FAIL", "ok"]
    marks = [[f["baseline"] for f in ln["failures"]] for ln in rep.lines_json()]
    assert marks == [["known", "known"], ["new"], []]
    # with B known too the run is clean: exit 0, led by the first known failure
    base.findings[_finding({"prop": "P1", "check": "I1", "field": "global_num_tokens_gpu", "runner": "single_layer", "step": 0,
                            "branch": "mlp_tp_gather"})] = ""
    rep.classify(base, "known.json")
    assert rep.exit_code() == 0 and rep.lead() is a


def test_a_written_baseline_reads_back_the_same_and_keeps_its_reasons(tmp_path):
    base = Baseline("sglang", {_finding(STALE): "the NPU twin, reported upstream", _finding({**STALE, "branch": "mlp_tp_gather"}): ""},
                    "sglang 0.5.23")
    path = tmp_path / "known.json"
    base.write(path)
    back = Baseline.load(path)
    assert back.findings == base.findings and back.engine == "sglang" and back.written_from == "sglang 0.5.23"
    doc = json.loads(path.read_text())
    assert doc["findings"][1] == {**STALE, "reason": "the NPU twin, reported upstream"}  # sorted by identity: mlp_tp_gather < neither
    assert list(doc["findings"][0]) == ["prop", "check", "field", "runner", "step", "branch", "path"]  # a fixed, readable key order


def _finding(entry: dict) -> Finding:
    where = {k: v for k, v in entry.items() if k not in ("prop", "check", "field")}
    return Finding.of(where, Failure(entry["prop"], entry["check"], entry["field"], {}, None, None), ())


def _main(*args: str) -> tuple[int, str, str]:
    from harness.engines.command import add_arguments, main

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(parser.parse_args(list(args)))
    assert "sglang" not in sys.modules, "an error path loaded an engine into the test process"
    return rc, out.getvalue(), err.getvalue()


# ---- the device paths (SGLang) ----


def test_the_fill_plan_runs_each_path_where_the_release_has_it():
    kernel_layouts = (ParallelLayout(4),)
    tp4, dp2 = ParallelLayout(4), ParallelLayout(4, 2, True)
    gpu, npu = frozenset({FillPath.GPU}), frozenset({FillPath.NPU})
    # 0.5.17 on: the kernel and its native twin
    both = FillPlan(True, True, ALL_PATHS, kernel_layouts)
    assert [both.kernel_fills(lay, d) for lay, d in ((tp4, 0), (dp2, 0), (dp2, 1))] == [True, False, False]
    assert both.twin_beside(True) and both.one_graph and both.line_path(True) == "gpu" and both.line_path(False) == "npu"
    only_gpu = FillPlan(True, True, gpu, kernel_layouts)
    assert only_gpu.kernel_fills(dp2, 1) and not only_gpu.twin_beside(True) and only_gpu.one_graph
    only_npu = FillPlan(True, True, npu, kernel_layouts)
    assert not only_npu.kernel_fills(tp4, 0) and not only_npu.one_graph and only_npu.line_path(False) == "npu"
    assert any("--path npu" in why and why.startswith("multi_layer_1g") for why in only_npu.skipped((tp4,)))
    # 0.5.16: the kernel, no twin: both devices run it, its lines carry no path; only the one graph is the GPU's
    k16 = FillPlan(True, False, npu, kernel_layouts)
    assert k16.kernel_fills(dp2, 1) and k16.line_path(True) == "" and not k16.twin_beside(True) and not k16.one_graph
    # up to 0.5.15: Python fills, no path at all
    py = FillPlan(False, False, gpu, kernel_layouts)
    assert not py.kernel_fills(tp4, 0) and py.line_path(False) == "" and py.skipped((tp4,)) == []
    assert Selection.from_args("npu", ["multi_layer"]).left_out(("multi_layer", "single_layer")) == [
        "single_layer: not checked (this run selected --runner multi_layer)"]


# ---- memory: the interpreter's bounds check, the child process ----


def test_an_interpreted_kernel_that_writes_past_its_buffer_is_masked_off_and_reported():
    """A kernel storing 4 elements past a 16-element buffer: those lanes are masked off before they touch memory and the
    access is recorded, naming the kernel, the program, the argument; its 16 lanes in bounds are written. Through guarded()
    it is a finding of the call that launched it; a launch within bounds records nothing."""
    proc = run_python(textwrap.dedent("""
        import json, torch, triton, triton.language as tl
        from harness.engines import interpreter
        from harness.engines.guard import guarded
        from harness.verdict import Verdict
        interpreter.prepare_interpreter()

        @triton.jit
        def fill(out_ptr, n, extra, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(out_ptr + offs, offs + 1, mask=offs < n + extra)

        out = torch.zeros(16, dtype=torch.int32)
        guard = torch.zeros(64, dtype=torch.int32)  # what the heap may hold past it
        fill[(1,)](out, 16, 0, BLOCK=32)
        clean = list(interpreter.VIOLATIONS)
        out.zero_()
        v = Verdict("P1")
        guarded(v, "fill", {"runner": "r"}, lambda: fill[(1,)](out, 16, 4, BLOCK=32))
        print(json.dumps({"clean": len(clean), "out": out.tolist(), "guard": guard.tolist(), "left": len(interpreter.VIOLATIONS),
                          "failures": [[f.check, f.field, f.where, f.got] for f in v.failures]}))
    """), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["clean"] == 0 and got["out"] == list(range(1, 17)) and got["guard"] == [0] * 64 and got["left"] == 0
    [[check, field, where, message]] = got["failures"]
    assert (check, field, where) == ("out of bounds", "fill", {"runner": "r", "kernel": "fill", "argument": "out_ptr"})
    assert message.startswith("interpreted Triton kernel fill, program (0, 0, 0): a masked store of 20 element(s) reaches 4 outside")
    assert "the first at bytes [64, 68) of argument `out_ptr`, whose storage holds 64; masked off" in message, message


def test_accesses_spanning_two_arguments_pass_and_a_lane_in_the_gap_between_them_is_masked_off():
    """A launch's accesses are checked against each argument's storage on its own: lanes in two arguments (the lowest in
    one, the highest in the other) are in bounds, a lane between or past them is not, whatever the others' addresses."""
    from triton.language import int1, int32, pointer_type
    from triton.runtime.interpreter import TensorHandle

    from harness.engines import interpreter

    a, b = torch.zeros(16, dtype=torch.int32), torch.zeros(16, dtype=torch.int32)  # 64 bytes each, wherever the heap puts them
    launch = interpreter._Launch("k")
    launch.bind([("a_ptr", a), ("b_ptr", b)])
    lo, hi = sorted((a, b), key=lambda t: t.data_ptr())
    mark = len(interpreter.VIOLATIONS)

    def check(addrs: list[int], mask: list[bool]) -> object:
        ptrs = TensorHandle(np.array(addrs, dtype=np.uint64), pointer_type(int32))
        return launch.check("load", ptrs, TensorHandle(np.array(mask), int1), (0, 0, 0))

    ends = [lo.data_ptr(), lo.data_ptr() + 60, hi.data_ptr(), hi.data_ptr() + 60]
    assert check(ends, [True] * 4) is None  # both storages, from first to last element
    gap = lo.data_ptr() + 64 if hi.data_ptr() > lo.data_ptr() + 64 else hi.data_ptr() + 64  # past the lower one's storage
    keep = check([*ends, gap, hi.data_ptr() + 62], [True] * 5 + [False])  # the last lane is masked off already
    assert keep.tolist() == [True] * 4 + [False, False]
    [v] = interpreter.VIOLATIONS[mark:]
    del interpreter.VIOLATIONS[mark:]
    assert (v.kernel, v.op) == ("k", "load") and "reaches 1 outside every tensor argument's storage" in v.message, v


def test_a_pointer_loaded_from_a_table_is_in_bounds_inside_a_live_tensor_and_masked_off_outside_every_one():
    """A kernel storing through a pointer it loads from memory (vLLM's block-table pointers): into a live tensor whose
    address was asked with data_ptr() (found among the tensors noted then, the frozen heap left frozen: no scan), into one
    whose address came another way (found by the scan of live objects, which thaws the heap), and into memory no tensor
    holds (a numpy buffer), where the lanes are masked off and recorded, and the buffer keeps its zeros."""
    proc = run_python(textwrap.dedent("""
        import gc, json, numpy as np, torch, triton, triton.language as tl
        from harness.engines import interpreter
        interpreter.prepare_interpreter()

        @triton.jit
        def through_table(table_ptr, BLOCK: tl.constexpr):
            dst = tl.cast(tl.load(table_ptr), tl.pointer_type(tl.int32))
            offs = tl.arange(0, BLOCK)
            tl.store(dst + offs, offs + 1, mask=offs < BLOCK)

        asked, other, untracked = torch.zeros(16, dtype=torch.int32), torch.zeros(16, dtype=torch.int32), np.zeros(16, np.int32)
        gc.collect()
        gc.freeze()
        got = {}
        for name, address in (("asked", asked.data_ptr()), ("other", other.untyped_storage().data_ptr()),
                              ("untracked", untracked.ctypes.data)):
            mark = len(interpreter.VIOLATIONS)
            through_table[(1,)](torch.tensor([address], dtype=torch.uint64), BLOCK=16)
            got[name] = {"frozen": gc.get_freeze_count() > 0, "violations": [[v.kernel, v.op, v.message] for v in interpreter.VIOLATIONS[mark:]]}
        print(json.dumps({**got, "asked_values": asked.tolist(), "other_values": other.tolist(), "untracked_values": untracked.tolist()}))
    """), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["asked"] == {"frozen": True, "violations": []}, got["asked"]
    assert got["other"] == {"frozen": False, "violations": []}, got["other"]
    assert got["asked_values"] == got["other_values"] == list(range(1, 17))
    [[kernel, op, message]] = got["untracked"]["violations"]
    assert (kernel, op) == ("through_table", "store") and "a masked store of 16 element(s) reaches 16 outside" in message, message
    assert got["untracked_values"] == [0] * 16


def test_tuple_types_named_on_first_read_have_the_names_triton_gives_them():
    """name_tuple_types_on_use() defers a tuple type's name to its first read: the same text as Triton's eager one, for
    unnamed and named members, a tensor's shape and an empty tuple; equality is the members', as before."""
    proc = run_python(textwrap.dedent("""
        import json, triton.language as tl
        from triton.language.core import tuple_type, _type_for_tuple_values
        from runners.attention.triton_interpreter import name_tuple_types_on_use
        made = lambda: [_type_for_tuple_values([tl.constexpr(4), 3, tl.int32]), tuple_type([tl.int32, tl.float16], ["a", "b"]),
                        tuple_type([]), tl.tuple([tl.constexpr(8), tl.constexpr(2)]).type]
        eager = [t.name for t in made()]
        name_tuple_types_on_use()
        name_tuple_types_on_use()  # idempotent
        lazy = made()
        print(json.dumps({"eager": eager, "lazy": [str(t) for t in lazy], "deferred": ["name" not in vars(t) for t in made()],
                          "equal": lazy[1] == tuple_type([tl.int32, tl.float16], ["a", "b"]) and lazy[1] != lazy[2]}))
    """))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["eager"] == ["[:constexpr_type[4],:constexpr_type[3],:constexpr_type[int32]]", "[a:int32,b:fp16]", "[]",
                            "[:constexpr_type[8],:constexpr_type[2]]"]
    assert got["lazy"] == got["eager"] and got["deferred"] == [True] * 4 and got["equal"]


def test_tuples_typed_on_first_read_have_the_types_triton_gives_them():
    """type_tuples_on_use() defers an untyped triton.language tuple's type to its first read: equal to, and printed as,
    the type Triton works out when the tuple is made; a type given at construction is kept (a list of types made a
    tuple type, as Triton does), and _setitem's new member is in the type read after it."""
    proc = run_python(textwrap.dedent("""
        import json, triton.language as tl
        from triton.language.core import tuple_type
        from runners.attention.triton_interpreter import type_tuples_on_use
        given = tuple_type([tl.int32, tl.float16], ["a", "b"])
        made = lambda: [tl.tuple([tl.constexpr(4), 3, tl.int32]), tl.tuple([]), tl.tuple([1, 2], given), tl.tuple([7], [tl.int64])]
        eager = [str(t.type) for t in made()]
        type_tuples_on_use()
        type_tuples_on_use()  # idempotent
        lazy = made()
        deferred = ["type" not in vars(t) for t in lazy]
        edited = tl.tuple([1, 2])
        edited._setitem(1, tl.constexpr(5))
        print(json.dumps({"eager": eager, "lazy": [str(t.type) for t in lazy], "deferred": deferred, "kept": lazy[2].type is given,
                          "edited": str(edited.type)}))
    """))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["eager"] == ["[:constexpr_type[4],:constexpr_type[3],:constexpr_type[int32]]", "[]", "[a:int32,b:fp16]", "[:int64]"]
    assert got["lazy"] == got["eager"] and got["deferred"] == [True, True, False, False] and got["kept"]
    assert got["edited"] == "[:constexpr_type[1],:constexpr_type[5]]"


def test_the_integer_overflow_check_runs_as_triton_has_it_only_where_its_assertion_is_kept():
    """prepare_interpreter() skips building the overflow condition of an int32 add only where device_assert would drop it
    (the interpreter's options, debug off): the add wraps as it does on a GPU; with debug on, the check runs and fails."""
    proc = run_python(textwrap.dedent("""
        import dataclasses, json, torch, triton, triton.language as tl
        from triton.runtime import interpreter as interp
        from harness.engines import interpreter
        interpreter.prepare_interpreter()
        interpreter.prepare_interpreter()  # idempotent

        @triton.jit
        def add(x_ptr, out_ptr, k):
            tl.store(out_ptr, tl.load(x_ptr) + k)

        x, out = torch.tensor([2**31 - 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        add[(1,)](x, out, 1)
        wrapped = out.tolist()
        interp.interpreter_builder.options = dataclasses.replace(interp.interpreter_builder.options, debug=True)
        try:
            add[(1,)](x, out, 1)
            raised = ""
        except Exception as e:
            raised = str(e)
        print(json.dumps({"wrapped": wrapped, "raised": raised}))
    """), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["wrapped"] == [-2**31]
    assert "int32 overflow detected for operation add" in got["raised"], got


def test_a_call_the_process_dies_in_is_recorded_and_the_rest_still_reported():
    """run_isolated: the child dies in a guarded call (a segfault); the re-run makes that call nowhere and records where it
    died, the other calls' results intact. A death outside any guarded call has nothing to skip: ChildDied."""
    proc = run_python(textwrap.dedent("""
        import ctypes, json
        from harness.engines.guard import guarded
        from harness.engines.isolate import ChildDied, run_isolated
        from harness.verdict import Verdict

        def check():
            v = Verdict("P1")
            got = [guarded(v, "replay", {"runner": "r", "iteration": it}, lambda it=it: ctypes.string_at(0) if it == 1 else it)
                   for it in range(3)]
            return got, [(f.check, f.field, f.where["iteration"], f.got) for f in v.failures]

        logs = []
        got, failures = run_isolated(check, logs.append)
        try:
            run_isolated(lambda: ctypes.string_at(0), logs.append)
            died = None
        except ChildDied as e:
            died = str(e)
        print(json.dumps({"got": got, "failures": failures, "logs": logs, "died": died}))
    """), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # iteration 0 ran before the crash; in the re-run the call is made nowhere, so 0 and 2 are "not made" and 1 is where it died
    assert out["got"] == [None, None, None]
    assert out["failures"] == [["crashed", "replay", 0, "not made"], ["crashed", "replay", 1, "the check process died (signal SIGSEGV)"],
                               ["crashed", "replay", 2, "not made"]]
    assert out["logs"] == ["the check process died (signal SIGSEGV) in replay (runner r) [runner=r, iteration=1]; checking again "
                           "without that call"]
    assert out["died"] and "outside any call into the engine" in out["died"], out["died"]


def test_live_storages_find_a_tensor_made_before_the_heap_was_frozen():
    """A pointer loaded from memory may name a tensor made before the process froze its heap (the suite freezes after
    collection); gc.get_objects() leaves frozen objects out, so the guard's scan thaws the heap before looking."""
    proc = run_python(textwrap.dedent("""
        import gc, numpy as np, torch
        from harness.engines.interpreter import _LiveStorages
        early = torch.arange(8, dtype=torch.int64)
        gc.collect()
        gc.freeze()
        found = _LiveStorages().holds(np.array([early.data_ptr() + 8], dtype=np.uint64), np.uint64(8))
        print(bool(found.all()), gc.get_freeze_count())
    """))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "0"]
