"""The GPU suite (`pytest -m gpu`, `tox -e gpu`, benchmarks/gpu_run.sh): real CUDA graphs, all
attention backends, fp32 and bf16.

What runs where (one GPU):
- world-size-1 layouts (tp1 "neither" and tp1 with moe_dense_tp_size=1, the attn-TP-gather
  branch) with real torch.cuda.CUDAGraph capture/replay: P1 (fast path and run path), P3
  (eager vs graph at raw_bs != bucket, graphs really replayed) and P4 (against TP1 eager),
  for torch, triton and flashinfer, fp32 and bf16;
- the CPU simulation vs the real graph on the same cases: replay records (every host and
  gpu metadata value) equal exactly, outputs within harness/props/tolerances.py's bounds; and the
  simulated graph on the GPU vs the real one, same kernels;
- every case file (larger layouts, simulated ranks as threads) on the GPU with the
  simulated graph backend (threads can't capture one CUDA graph together), torch backend;
- the attention kernels (triton, flashinfer) against the torch reference on the GPU.
Set SPECHARNESS_GPU_REPORT=path.json to collect the measured max differences (what the
GPU tolerances in harness/props/tolerances.py were set from).
"""
from __future__ import annotations

import json
import os
import tomllib
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch

from harness.props.outputs import compare_outputs
from harness.props.p1 import check_run_metadata
from harness.props.p1_metadata import check_metadata
from harness.props.p3 import check_eager_vs_graph
from harness.props.p4 import check_cross_layout
from harness.props.tolerances import attn_vs_reference, cross_device, eager_vs_graph
from harness.ranks.simulated import SimulatedWorld
from harness.run.records import device_independent
from harness.run.rig import RankRun, run_rank
from harness.run.scenario import Scenario
from harness.verdict import Verdict
from runners.attention import BACKENDS, unavailable_reason
from runners.attention.kinds import METADATA_IN_GRAPH
from runners.config import DraftExtendGraph

CASES = Path(__file__).resolve().parent.parent / "cases"
GPU_BACKENDS = ("torch", "triton", "flashinfer")
DTYPES = ("float32", "bfloat16")
MODELS = {
    "default": {},  # hidden 64, 8 heads of dim 8 (flashinfer has no head_dim-8 kernels)
    "hd64": {"hidden_size": 512, "num_heads": 8, "num_kv_heads": 2, "intermediate_size": 1024},
}
LAYOUTS = {"tp1": {"tp_size": 1}, "tp1_attn_tp_gather": {"tp_size": 1, "moe_dense_tp_size": 1}}

_REPORT: list[dict] = []


@pytest.fixture(scope="session", autouse=True)
def _fp32_is_fp32():
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (the tolerances say so)
        torch.backends.cudnn.allow_tf32 = False


def _record(entry: dict) -> None:
    """Keep a measured difference; rewrite SPECHARNESS_GPU_REPORT each time (a killed run keeps what it had)."""
    _REPORT.append(entry)
    path = os.environ.get("SPECHARNESS_GPU_REPORT")
    if path:
        meta = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__}
        Path(path).write_text(json.dumps({"meta": meta, "entries": _REPORT}, indent=1, default=str))


def _need(backend: str) -> None:
    if backend not in BACKENDS:
        pytest.skip(f"backend {backend}: {unavailable_reason(backend)}")


def make_case(layout: str, backend: str, dtype: str, model: str, batches=([3], [5], [1]), num_steps: int = 3, **spec):
    from harness.cases.case import parse_case

    data = tomllib.loads((CASES / "tp1_neither.toml").read_text())
    data.update(name=f"gpu_{layout}_{backend}_{dtype}_{model}", backend=backend, dtype=dtype, layout=dict(LAYOUTS[layout]))
    if MODELS[model]:
        data["model"] = dict(MODELS[model])
    data["spec"].update(num_steps=num_steps, **spec)
    data["schedule"]["batches"] = [list(b) for b in batches]
    return parse_case(data)


def run_world(sc: Scenario, graph_kind: str, device: str, runner: str = "both") -> list[RankRun]:
    return SimulatedWorld(sc.layout, timeout_s=900).run(lambda comm: run_rank(comm, sc, runner=runner, graph_kind=graph_kind, device=device))


def _max_diffs(a_steps, b_steps) -> list[dict]:
    out = []
    for it, (xa, xb) in enumerate(zip(a_steps, b_steps, strict=True)):
        for step, (a, b) in enumerate(zip(xa, xb, strict=True)):
            d = {"iteration": it, "step": step}
            for name in ("logits", "hidden", "logprobs"):
                x, y = getattr(a.out, name).double(), getattr(b.out, name).double()
                d[name] = float((x - y).abs().max()) if x.numel() and x.shape == y.shape else None
            d["top1_equal"] = bool(torch.equal(a.out.topk_index[:, :1], b.out.topk_index[:, :1]))
            out.append(d)
    return out


def _report(kind: str, case, **extra) -> None:
    _record({"check": kind, "case": case.name, "backend": case.scenario.attention_backend, "dtype": case.scenario.model.dtype,
             "layout": case.layout.describe(), **extra})


def _assert_ok(*verdicts: Verdict) -> None:
    for v in verdicts:
        assert v.ok, f"{v.prop}: {v.first()}"


# ---------------------------------------------------------------------------------------
# P1, P3, P4 with real CUDA graphs, every backend and dtype, both world-size-1 branches
# ---------------------------------------------------------------------------------------

def _composites(backend: str) -> list[DraftExtendGraph]:
    """The draft-extend composites a backend runs: the one graph needs its metadata built in the graph (not flashinfer)."""
    return [g for g in DraftExtendGraph if g is DraftExtendGraph.PER_STEP or backend in METADATA_IN_GRAPH]


GRID = [(lay, be, dt, mo, g) for lay in LAYOUTS for be in GPU_BACKENDS for dt in DTYPES for mo in MODELS for g in _composites(be)
        if not (be == "flashinfer" and mo == "default")]


@pytest.mark.gpu
@pytest.mark.parametrize("layout,backend,dtype,model,graph", GRID, ids=["-".join(g) for g in GRID])
def test_properties_with_real_cuda_graphs(layout, backend, dtype, model, graph):
    _need(backend)
    case = make_case(layout, backend, dtype, model, draft_extend_graph=graph.value)
    sc = case.scenario
    runs = run_world(sc, "cuda", "cuda")
    per_iteration = 1 if graph is DraftExtendGraph.ONE_GRAPH else sc.spec.num_steps  # one graph replays once for every step
    assert runs[0].stats.replays == per_iteration * len(runs[0].records) > 0
    oracle = run_world(sc.as_tp1(), "cuda", "cuda", runner="eager")
    _report("eager_vs_graph", case, model=model, graph=graph.value, tol=eager_vs_graph("cuda", dtype, backend), diffs=_max_diffs(runs[0].eager, runs[0].graph))
    _assert_ok(
        check_metadata(sc.layout, sc.spec, case.schedule, sc.model, sc.seed),
        check_run_metadata(sc, runs),
        check_eager_vs_graph(sc, runs, "cuda"),
        check_cross_layout(sc, runs, oracle, "eager"),
        check_cross_layout(sc, runs, oracle, "graph"),
    )


# ---------------------------------------------------------------------------------------
# the CPU simulation (and the simulated graph on the GPU) vs the real graph
# ---------------------------------------------------------------------------------------

def _records_equal(v: Verdict, where: dict, ra: RankRun, rb: RankRun) -> None:
    for it, (xa, xb) in enumerate(zip(ra.records, rb.records, strict=True)):
        for step, (a, b) in enumerate(zip(xa, xb, strict=True)):
            v.checked += 1
            a, b = device_independent(a), device_independent(b)  # the tensors a kernel fill wrote show on CPU only
            if a != b:
                diff = {f.name: (getattr(a, f.name), getattr(b, f.name)) for f in fields(a) if getattr(a, f.name) != getattr(b, f.name)}
                v.fail("sim-vs-real", "replay record", {**where, "iteration": it, "step": step}, "equal", "differs", str(diff)[:400])


SIM_GRID = [(lay, be, dt, g) for lay in LAYOUTS for be in GPU_BACKENDS for dt in DTYPES for g in _composites(be)]


@pytest.mark.gpu
@pytest.mark.parametrize("layout,backend,dtype,graph", SIM_GRID, ids=["-".join(g) for g in SIM_GRID])
def test_cpu_simulation_agrees_with_real_graph(layout, backend, dtype, graph):
    """Same case three ways: real CUDA graph on the GPU, simulated graph on the GPU, simulated
    graph on CPU (torch backend there: the CPU reference). Metadata exactly; outputs within bounds."""
    _need(backend)
    model = "hd64" if backend == "flashinfer" else "default"
    case = make_case(layout, backend, dtype, model, draft_extend_graph=graph.value)
    sc = case.scenario
    real = run_world(sc, "cuda", "cuda", runner="graph")[0]
    sim_cpu = run_world(replace(sc, attention_backend="torch"), "sim", "cpu", runner="graph")[0]
    legs = [("sim-cpu", sim_cpu, cross_device(dtype, backend))]
    if backend != "flashinfer":  # flashinfer's kernels bypass the dispatcher: the recording graph refuses them
        legs.append(("sim-gpu", run_world(sc, "sim", "cuda", runner="graph")[0], eager_vs_graph("cuda", dtype, backend)))
    v = Verdict("sim-vs-real")
    T = sc.spec.num_tokens_per_bs
    for name, other, tol in legs:
        where = {"case": case.name, "against": name}
        _records_equal(v, where, real, other)
        for it, (xa, xb) in enumerate(zip(real.graph, other.graph, strict=True)):
            for step, (a, b) in enumerate(zip(xa, xb, strict=True)):
                if not compare_outputs(v, "sim-vs-real", {**where, "iteration": it, "step": step}, b.out.tensors(), a.out.tensors(), tol,
                                       lambda r: f"row {r} (token {r % T})"):
                    break
        _report("sim_vs_real", case, against=name, graph=graph.value, tol=tol, diffs=_max_diffs(real.graph, other.graph))
    _assert_ok(v)


# ---------------------------------------------------------------------------------------
# larger layouts on the GPU: simulated ranks (threads) with the simulated graph backend
# ---------------------------------------------------------------------------------------

def _case_files():
    return sorted(p.stem for p in CASES.glob("*.toml"))


@pytest.mark.gpu
@pytest.mark.parametrize("name", _case_files())
def test_case_files_on_gpu_with_simulated_graphs(name):
    from harness.cases.case import load_case

    case = load_case(name)
    sc = case.scenario
    if sc.attention_backend not in BACKENDS:
        pytest.skip(f"backend {sc.attention_backend}: {unavailable_reason(sc.attention_backend)}")
    runs = run_world(sc, "sim", "cuda")
    oracle = run_world(sc.as_tp1(), "sim", "cuda", runner="eager")
    _assert_ok(
        check_run_metadata(sc, runs),
        check_eager_vs_graph(sc, runs, "cuda"),
        check_cross_layout(sc, runs, oracle, "eager"),
        check_cross_layout(sc, runs, oracle, "graph"),
    )


# ---------------------------------------------------------------------------------------
# attention kernels against the torch reference, on the GPU
# ---------------------------------------------------------------------------------------

def _paged(prefixes, T, hq, hkv, d, dtype, pad_lanes=0, mode=None):
    from runners.batch import ForwardMode
    from tests.test_triton_backend import paged_batch  # the CPU tests' batch builder

    return paged_batch(prefixes, T, hq, hkv, d, dtype=dtype, pad_lanes=pad_lanes, mode=mode or ForwardMode.DRAFT_EXTEND_V2)


KERNEL_GRID = [(be, dt, mode) for be in ("triton", "flashinfer") for dt in DTYPES for mode in ("extend", "decode")]


@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype,mode", KERNEL_GRID, ids=["-".join(g) for g in KERNEL_GRID])
def test_attention_kernels_match_reference_on_gpu(backend, dtype, mode):
    _need(backend)
    from runners.attention import make_backend
    from runners.attention.torch_ref import TorchAttnBackend
    from runners.batch import ForwardMode

    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    fm = ForwardMode.DECODE if mode == "decode" else ForwardMode.DRAFT_EXTEND_V2
    T = 1 if mode == "decode" else 4
    d = 64 if backend == "flashinfer" else 8
    prefixes = [5, 40, 17, 59]
    rp, kp, fb, q, k, v = _paged(prefixes, T, 8, 2, d, tdt, pad_lanes=0 if mode == "decode" else 2, mode=fm)
    ref = TorchAttnBackend(rp, kp)
    o_ref = ref.forward(0, q, k, v, fb, ref.init_forward_metadata(fb))
    be = make_backend(backend, req_pool=rp, kv_pool=kp)
    o = be.forward(0, q, k, v, fb, be.init_forward_metadata(fb))
    rows = len(prefixes) * T  # padded lanes: flashinfer gives them kv_len = T (garbage rows by design)
    tol = attn_vs_reference(dtype, backend)
    diff = float((o[:rows].float() - o_ref[:rows].float()).abs().max())
    _record({"check": "attn_vs_reference", "backend": backend, "dtype": dtype, "mode": mode, "max_abs_diff": diff, "tol": tol})
    torch.testing.assert_close(o[:rows].float(), o_ref[:rows].float(), rtol=tol.rtol, atol=tol.atol, msg=lambda m: f"{m}\n({tol.reason})")
    assert torch.isfinite(o).all()


@pytest.mark.gpu
def test_flashinfer_replay_without_replan_is_caught(monkeypatch):
    """The re-plan before replay matters: without it the graph replays the warm-up's plan
    (the capture-time lengths) and P3 must fail."""
    _need("flashinfer")
    from runners.attention.flashinfer_backend import FlashInferAttnBackend

    monkeypatch.setattr(FlashInferAttnBackend, "init_forward_metadata_replay_cuda_graph", lambda self, fb: None)
    case = make_case("tp1", "flashinfer", "bfloat16", "hd64")
    runs = run_world(case.scenario, "cuda", "cuda")
    assert not check_eager_vs_graph(case.scenario, runs, "cuda").ok


@pytest.mark.gpu
def test_capture_survives_the_collector_freeing_dead_graphs():
    """Regression: dead runners (cycles owning CUDAGraphs) collected mid-capture invalidated it.

    The collector is made to run inside the capture (threshold 1 once capture has begun) with dead
    graph-owning cycles waiting in generation 0; benchmarks/capture_gc_probe.py runs the same
    capture without runners.graph.backend.no_gc_during_capture and shows it failing.
    """
    import gc

    from benchmarks.capture_gc_probe import capture_once, plant

    saved = gc.get_threshold()
    try:
        plant(4, with_graph=True)
        err = capture_once(guarded=True, explicit_collect=False)
    finally:
        gc.set_threshold(*saved)
    assert err is None, err
    assert gc.isenabled()


@pytest.mark.gpu
def test_bench_runs_on_gpu():
    from harness.bench.command import format_table, run_bench

    args = _bench_args(device="cuda", backend="all", bs="1,4", replays=3)
    res = run_bench(args)
    assert not res["meta"]["simulation"]
    assert {b["backend"] for b in res["backends"]} == {b for b in GPU_BACKENDS if b in BACKENDS}
    assert "real CUDA graphs" in format_table(res)


# ---------------------------------------------------------------------------------------
# CPU: the bench's simulation table (not a GPU test; runs in the CPU suite)
# ---------------------------------------------------------------------------------------

def _bench_args(**over):
    import argparse

    from harness.bench.command import add_parser

    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["bench", "--quick", "--warmup", "0"])
    for k, v in over.items():
        setattr(args, k, v)
    return args


def test_bench_cpu_simulation_smoke(tmp_path):
    from harness.bench.command import format_table, main, run_bench

    args = _bench_args(device="cpu", backend="torch", bs="1,2", replays=2, num_steps=1)
    res = run_bench(args)
    assert res["meta"]["simulation"] and res["meta"]["device_type"] == "cpu"
    (b,) = res["backends"]
    assert [r["bs"] for r in b["rows"]] == [1, 2]
    assert all(r["max_abs_diff_logits"] <= 1e-5 for r in b["rows"])  # the simulated replay computes what eager does
    assert b["capture"]["graphs"] == 2 and set(b["capture"]["per_bucket_s"]) == {"1", "2"}
    assert "CPU SIMULATION" in format_table(res)
    out = tmp_path / "bench.json"
    args.json = str(out)
    assert main(args) == 0
    assert json.loads(out.read_text())["backends"][0]["rows"][0]["bs"] == 1


def test_bench_rejects_too_few_replays():
    from harness.bench.command import run_bench

    with pytest.raises(SystemExit, match="replays"):
        run_bench(_bench_args(device="cpu", backend="torch", replays=5, quick=False))


def test_bench_on_cpu_is_short_by_default_with_progress_and_spread(monkeypatch, capsys):
    """The issue: `harness bench` on CPU ran 5 minutes silent, then printed speedups that swung 0.3x-1.3x with no spread.
    No timing is asserted: the defaults, the progress lines, min <= median <= max, and the warning of a loaded machine."""
    from harness.bench import command as bench
    from harness.bench import timer as bench_timer
    from harness.bench.command import CPU_BS, REPLAYS, format_table, run_bench

    args = _bench_args(device="cpu", backend="torch", bs=None, replays=None, quick=False, num_steps=1)
    assert bench._defaults(args, torch.device("cpu")) == (list(CPU_BS), REPLAYS["cpu"]) == ([1, 8], 15)
    assert bench._defaults(args, torch.device("cuda")) == ([1, 2, 4, 8, 16, 32, 64], 50)
    monkeypatch.setattr(bench_timer.os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    said: list[str] = []
    res = run_bench(_bench_args(device="cpu", backend="torch", bs="1,2", replays=3, num_steps=1), progress=said.append)
    assert said[0].startswith("warning: load average 64.0 on") and "timings are perturbed" in said[0]
    assert [ln.split(":")[0] for ln in said if ln.startswith("[torch] bs")] == ["[torch] bs 1 (1/2)", "[torch] bs 2 (2/2)"]
    for row in res["backends"][0]["rows"]:
        for s in row["spread_ms"].values():
            assert s["min"] <= s["median"] <= s["max"]
    table = format_table(res)
    assert "median [min-max]" in table and res["meta"]["warnings"] and res["meta"]["warnings"][0] in table
    monkeypatch.setattr(bench_timer.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert bench_timer.load_warning(torch.device("cpu")) is None
