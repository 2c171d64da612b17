"""The draft decode (EAGLEDraftCudaGraphRunner) and target verify (DecodeCudaGraphRunner) runners
under real CUDA graphs (marker `gpu`), on the world-size-1 layouts (a simulated multi-rank world cannot
sit inside one CUDA graph): P1 (every replay's record against its capture record: I1 / I4 / I5, the
padding rules, I2 rows fed), P3 (eager vs graph at raw_bs below, at and after a shrink to a bucket),
for the torch, triton and flashinfer backends, fp32 and bf16; and the CPU recorded graph against the
real CUDA graph on the same rig (records exactly, outputs within harness/props/tolerances.py cross_device).
One CPU test runs the same checks with the recorded graph, so this file's logic runs in the CPU suite.
"""
from __future__ import annotations

import pytest
import torch

from harness.bench.command import format_table, run_bench
from harness.bench.runners import RunnerRig, build_rig, format_runner_table, rig_spec
from harness.props.draft_decode import compare_tree
from harness.props.outputs import first_bad_row
from harness.props.p1_records import check_replay_record, check_replay_rows
from harness.props.tolerances import Tol, cross_device, eager_vs_graph
from harness.ranks.simulated import SimulatedWorld
from harness.run.observe import RunnerObserver
from harness.run.records import device_independent
from harness.run.scenario import release
from harness.verdict import Verdict
from runners.attention import BACKENDS, unavailable_reason
from runners.config import ModelConfig
from runners.parallel.layout import ParallelLayout
from tests.test_gpu import _bench_args, _record  # the GPU report (SPECHARNESS_GPU_REPORT): measured max differences

LAYOUTS = {"tp1": ParallelLayout(), "tp1_attn_tp_gather": ParallelLayout(tp_size=1, moe_dense_tp_size=1)}
BACKENDS_GPU = ("torch", "triton", "flashinfer")
DTYPES = ("float32", "bfloat16")
BUCKETS = (1, 2, 4, 8)
# The target verify in bf16, CPU vs GPU: two target layers over a random (N(0, 1)) prefix KV, every
# activation rounded to bf16 on each side in a different order. The CPU rig's own bf16 run differs from
# its fp32 run by up to 0.098 on logits of std ~1 (max |x| ~3.9), so two bf16 runs may differ by
# twice that; the fp32 comparison of the same pass holds cross_device's 1e-4, so nothing but rounding
# differs. A wrong row or slot moves logits by O(1) (the logit std), 5x this bound.
VERIFY_BF16_CROSS_DEVICE = Tol(5e-2, 2e-1, "bf16 target verify, 2 layers: each device's bf16 rounding (~0.1 from fp32, measured on CPU)")
SCHEDULE = (3, 8, 1, 5)  # padded (3 in 4), a full bucket, a shrink to the smallest, padded again (5 in 8)


def _model(backend: str, dtype: str) -> ModelConfig:
    if backend == "flashinfer":  # no head_dim-8 kernels: the head_dim-64 model
        return ModelConfig(hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=1024, dtype=dtype)
    return ModelConfig(dtype=dtype)


def _need(backend: str) -> None:
    if backend not in BACKENDS:
        pytest.skip(f"backend {backend}: {unavailable_reason(backend)}")


def _run(layout: ParallelLayout, backend: str, dtype: str, device: str, graph_kind: str, topk: int, runners: tuple[str, ...],
         model: ModelConfig | None = None):
    """{runner: _steps} from one rig that builds and captures only those runners."""
    model = model or _model(backend, dtype)

    def fn(comm):
        rig = build_rig(comm, model, rig_spec(BUCKETS, topk=topk), backend, torch.device(device), graph_kind, layout,
                        runners=runners)
        return _steps(rig, runners)

    return SimulatedWorld(layout, timeout_s=900).run(fn)[0]


def _steps(rig: RunnerRig, runners: tuple[str, ...]) -> dict[str, list]:
    """Per runner and schedule entry: (iteration, raw_bs, eager output, graph output, replay record)."""
    out = {r: [] for r in runners}
    observers = {r: RunnerObserver(getattr(rig, r)).attach() for r in runners}
    for it, raw_bs in enumerate(SCHEDULE):
        batch = rig.batch(raw_bs, 1000 * (it + 1))
        for runner in runners:
            if runner == "decode":
                inp = rig.decode_inputs(batch, seed=it)
                ref = rig.eager_decode(inp)
                got = rig.decode.replay(inp).cloned()  # kept past the next replay, which overwrites the views it returns
                ref, got = ref.tensors(), got.tensors()
            else:
                lanes = rig.verify_lanes(batch, seed=it)
                ref = rig.eager_verify(lanes)
                got = rig.verify.replay(rig.verify_inputs(lanes)).cloned()
                ref, got = {"logits": ref.logits, "hidden": ref.hidden}, {"logits": got.logits, "hidden": got.hidden}
            rec = observers[runner].replays[-1]
            out[runner].append((it, raw_bs, {k: v.cpu() for k, v in ref.items()}, {k: v.cpu() for k, v in got.items()}, rec))
        release(rig.worker, batch)
    return out


def _check_p1_p3(layout: ParallelLayout, steps, runner: str, rows_per_bs: int, tol) -> dict[str, Verdict]:
    p1, p3 = Verdict("P1"), Verdict("P3")
    for it, raw_bs, ref, got, rec in steps:
        where = {"layout": layout.describe(), "runner": runner, "iteration": it, "raw_bs": raw_bs, "bs": rec.bs}
        check_replay_record(p1, layout, rec, 0, it, raw_bs)  # world size 1: this rank's batch decides the bucket
        check_replay_rows(p1, layout, rec, 0, it, expected_rows=rec.bs * rows_per_bs)
        if runner == "decode":
            compare_tree(p3, where, ref, got, tol)
        else:
            _compare_rows(p3, where, ref, got, tol)
    p3.expect_equal("P3", "padded replays", {"runner": runner}, True, any(rec.bs > raw_bs for _, raw_bs, _, _, rec in steps),
                    "the schedule pads a batch into a larger bucket")
    return {"P1": p1, "P3": p3}


def _compare_rows(v: Verdict, where: dict, ref: dict, got: dict, tol) -> None:
    for name in ("logits", "hidden"):
        v.checked += 1
        if ref[name].shape != got[name].shape:
            v.fail("P3", name, where, tuple(ref[name].shape), tuple(got[name].shape), "shape")
            continue
        bad = first_bad_row(ref[name], got[name], tol)
        if bad is not None:
            v.fail("P3", name, {**where, "row": bad[0]}, "match", f"max |diff| {bad[1]:.3g}", "bitwise" if tol is None else tol.reason)


def _max_diff(pairs, field: str) -> float:
    """max |a - b| of `field` over (a, b) output pairs of equal shape (NaN where none compares)."""
    d = [float((a[field].double() - b[field].double()).abs().max()) for a, b in pairs if a[field].shape == b[field].shape and a[field].numel()]
    return max(d) if d else float("nan")


def _report(check: str, layout: str, backend: str, dtype: str, runner: str, pairs, tol) -> None:
    field = "step_logits" if runner == "decode" else "logits"
    _record({"check": check, "runner": runner, "layout": layout, "backend": backend, "dtype": dtype, "field": field,
             "max_abs_diff": _max_diff(pairs, field), "tol": None if tol is None else [tol.rtol, tol.atol]})


def _assert_ok(verdicts: dict[str, Verdict]) -> None:
    for v in verdicts.values():
        assert v.ok, f"{v.prop}: {v.first()}"


GRID = [(lay, be, dt) for lay in LAYOUTS for be in BACKENDS_GPU for dt in DTYPES]
IDS = ["-".join(g) for g in GRID]


@pytest.mark.gpu
@pytest.mark.parametrize("layout,backend,dtype", GRID, ids=IDS)
@pytest.mark.parametrize("topk", [1, 2])
def test_draft_decode_runner_under_real_cuda_graphs(layout, backend, dtype, topk):
    _need(backend)
    lay = LAYOUTS[layout]
    steps = _run(lay, backend, dtype, "cuda", "cuda", topk, ("decode",))["decode"]
    tol = eager_vs_graph("cuda", dtype, backend)  # the draft decode attends with the case's backend
    _report(f"eager_vs_graph topk{topk}", layout, backend, dtype, "decode", [(r, g) for _, _, r, g, _ in steps], tol)
    _assert_ok(_check_p1_p3(lay, steps, "decode", topk, tol))


@pytest.mark.gpu
@pytest.mark.parametrize("layout,backend,dtype", GRID, ids=IDS)
def test_target_verify_runner_under_real_cuda_graphs(layout, backend, dtype):
    _need(backend)
    lay = LAYOUTS[layout]
    steps = _run(lay, backend, dtype, "cuda", "cuda", 1, ("verify",))["verify"]
    T = rig_spec(BUCKETS).num_tokens_per_bs
    tol = eager_vs_graph("cuda", dtype, backend)
    _report("eager_vs_graph", layout, backend, dtype, "verify", [(r, g) for _, _, r, g, _ in steps], tol)
    _assert_ok(_check_p1_p3(lay, steps, "verify", T, tol))


@pytest.mark.parametrize("runner", ["decode", "verify"])
def test_runner_rig_p1_p3_with_the_recorded_cpu_graph(runner):
    """The same checks on CPU (recorded graph): fp32 with the torch backend is bitwise but for the padded-M GEMMs."""
    lay = LAYOUTS["tp1_attn_tp_gather"]
    steps = _run(lay, "torch", "float32", "cpu", "sim", 1, (runner,))[runner]
    rows = 1 if runner == "decode" else rig_spec(BUCKETS).num_tokens_per_bs
    _assert_ok(_check_p1_p3(lay, steps, runner, rows, eager_vs_graph("cpu", "float32")))


# ---- the CPU recorded graph vs the real CUDA graph ----
def _tree_across(v: Verdict, where: dict, ref: dict, got: dict, tol: Tol) -> None:
    """Per request (rows of different requests never mix): the step-0 logits always within tol; each later
    forward while the request's tree so far agrees. Where a kept token differs, the reference must show a
    near-tie there (the two devices rounded a tie apart): the graph's token within 2 * tol of the reference's
    by the reference's own logits; past it the inputs differ, so that request's later steps are not compared."""
    k = ref["tokens"].shape[2]
    for b in range(ref["tokens"].shape[0]):
        for i in range(ref["step_logits"].shape[0]):
            rows = slice(b * k, (b + 1) * k)
            v.checked += 1
            bad = first_bad_row(ref["step_logits"][i][rows], got["step_logits"][i][rows], tol)
            if bad is not None:
                v.fail("sim-vs-real", "step_logits", {**where, "request": b, "forward": i}, "match", f"max |diff| {bad[1]:.3g}", tol.reason)
                break
            if not torch.equal(ref["tokens"][b, i + 1], got["tokens"][b, i + 1]):
                logits = ref["step_logits"][i][rows].double()
                mine, theirs = ref["child_index"][b, i], got["child_index"][b, i]
                a, c = logits.gather(1, mine).flatten(), logits.gather(1, theirs).flatten()
                slack = 2 * (tol.atol + tol.rtol * a.abs())
                if not bool(((a - c).abs() <= slack).all()):
                    v.fail("sim-vs-real", "tokens", {**where, "request": b, "depth": i + 2}, ref["tokens"][b].tolist(),
                           got["tokens"][b].tolist(), "differs where the reference has no tie")
                break


@pytest.mark.gpu
@pytest.mark.parametrize("layout,backend,dtype", GRID, ids=IDS)
def test_cpu_recorded_graph_agrees_with_the_real_cuda_graph(layout, backend, dtype):
    """The same rig twice: real CUDA graphs with `backend` on the GPU, the recorded graph with the torch backend
    on CPU (the reference). Every replay record equal; outputs within cross_device."""
    _need(backend)
    lay = LAYOUTS[layout]
    v = Verdict("sim-vs-real")
    both = ("decode", "verify")
    model = _model(backend, dtype)  # the same model on both sides (flashinfer's head_dim-64 one on CPU too)
    real, sim = _run(lay, backend, dtype, "cuda", "cuda", 1, both, model), _run(lay, "torch", dtype, "cpu", "sim", 1, both, model)
    for runner in both:
        tol = cross_device(dtype, backend)  # both runners attend with `backend` on the GPU, the torch reference on CPU
        if runner == "verify" and dtype == "bfloat16":
            tol = VERIFY_BF16_CROSS_DEVICE
        _report("cpu_sim_vs_real", layout, backend, dtype, runner, [(a[3], b[3]) for a, b in zip(sim[runner], real[runner], strict=True)], tol)
        for (it, raw_bs, _, g_real, rec_real), (_, _, _, g_sim, rec_sim) in zip(real[runner], sim[runner], strict=True):
            where = {"layout": layout, "runner": runner, "iteration": it, "raw_bs": raw_bs}
            v.expect_equal("sim-vs-real", "replay record", where, device_independent(rec_sim), device_independent(rec_real),
                           "every host and gpu metadata value (the tensors a kernel fill wrote show on CPU only)")
            if runner == "decode":
                _tree_across(v, where, g_sim, g_real, tol)
            else:
                _compare_rows(v, where, g_sim, g_real, tol)
    assert v.ok, v.first()


def test_bench_runner_table_on_cpu():
    """`harness bench --runners on` on CPU (recorded graphs): a row per bs with every runner and the iteration."""
    res = run_bench(_bench_args(device="cpu", backend="torch", bs="1,2", replays=2, runners="on"))
    (b,) = res["runners"]
    assert [r["bs"] for r in b["rows"]] == [1, 2] and b["graph_kind"] == "sim"
    for r in b["rows"]:
        for name in ("extend", "decode", "verify", "iteration"):
            assert r[f"{name}_eager_ms"] > 0 and r[f"{name}_graph_ms"] > 0
    assert "every runner" in format_runner_table(res["runners"], res["meta"]) and "CPU SIMULATION" in format_table(res)
