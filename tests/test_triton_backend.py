"""The Triton attention backend against the torch reference, on CPU in Triton's interpreter.

The interpreter (TRITON_INTERPRET=1) is an oracle for the kernels' indexing and masks in
fp32 (docs/gpu.md, Backends): every test compares the kernels' output with the reference's on the
same paged KV cache. The variable must be set before triton is first imported; this file
sets it only when triton is not imported yet and CUDA is absent (the backend module does
the same on import), so it changes nothing for a process that already chose.
On a GPU machine these tests run the compiled kernels instead (tests/test_gpu.py covers
that path on purpose, with bf16 as well).
"""
from __future__ import annotations

import os
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.helpers.paged_batch import paged_batch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton_backend = pytest.importorskip("runners.attention.triton_backend", reason="triton is not installed (pip install triton==3.6.0)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from triton.runtime import interpreter as interp  # noqa: E402

from harness.props.tolerances import attn_vs_reference  # noqa: E402
from runners.attention import BACKENDS, make_backend  # noqa: E402
from runners.attention.torch_ref import TorchAttnBackend  # noqa: E402
from runners.attention.triton_launch import INTERPRET, run_kernel, tl, triton  # noqa: E402
from runners.batch import ForwardMode  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CASES = Path(__file__).resolve().parent.parent / "cases"


@pytest.fixture(autouse=True)
def _kernels_can_run():
    err = triton_backend.interpreter_error(DEVICE)
    if err is not None:
        pytest.fail(err)


def run_both(rp, kp, fb, q, k, v):
    """Reference first (it writes this pass's K/V), then the kernels on the same, now written, cache."""
    ref = TorchAttnBackend(rp, kp)
    tri = make_backend("triton", req_pool=rp, kv_pool=kp)
    o_ref = ref.forward(0, q, k, v, fb, ref.init_forward_metadata(fb))
    o_tri = tri.forward(0, q, k, v, fb, tri.init_forward_metadata(fb))
    return o_ref, o_tri


def assert_matches(o_ref, o_tri, dtype=torch.float32, rows=None):
    tol = attn_vs_reference(str(dtype).removeprefix("torch."))
    if rows is not None:
        o_ref, o_tri = o_ref[:rows], o_tri[:rows]
    torch.testing.assert_close(o_tri.float().cpu(), o_ref.float().cpu(), rtol=tol.rtol, atol=tol.atol, msg=lambda m: f"{m}\n({tol.reason})")


def test_registered_and_interpreted():
    assert "triton" in BACKENDS
    if DEVICE.type == "cpu":
        assert INTERPRET, "without CUDA the backend must run in Triton's interpreter"


@pytest.mark.parametrize(
    "prefixes,T,hq,hkv,d",
    [
        ([5, 40, 17], 4, 8, 2, 8),  # the default model's shape: GQA group 4, head_dim 8
        ([1, 60], 4, 4, 4, 16),  # no GQA; the second request fills max_context_len (64) exactly
        ([9], 5, 8, 1, 32),  # one KV head for 8 query heads; 40 rows in one block
        ([33, 2, 30, 12], 2, 2, 1, 64),  # head_dim 64 (the flashinfer-sized model), two key blocks
    ],
    ids=["default-gqa4", "mha-full-ctx", "mqa", "hd64"],
)
def test_extend_matches_reference(prefixes, T, hq, hkv, d):
    o_ref, o_tri = run_both(*paged_batch(prefixes, T, hq, hkv, d))
    assert_matches(o_ref, o_tri)


@pytest.mark.parametrize("stale", [False, True], ids=["pad-req0", "pad-stale-req"])
def test_padded_lanes_match_reference(stale):
    """Graph-replay padding: lanes with seq_len 1, position 0, the padding slot, and req index 0 or stale."""
    o_ref, o_tri = run_both(*paged_batch([7, 20], 4, 8, 2, 8, pad_lanes=2, stale_pad_req=stale))
    assert_matches(o_ref, o_tri)
    assert torch.isfinite(o_tri).all()


def test_decode_kernel_matches_reference():
    """DECODE: one token per request, the decode kernel (no tl.dot)."""
    o_ref, o_tri = run_both(*paged_batch([3, 50, 11, 0 + 1], 1, 8, 2, 8, mode=ForwardMode.DECODE))
    assert_matches(o_ref, o_tri)


def test_decode_kernel_on_extend_batch():
    """The decode kernel is per token: it must also agree on a multi-token batch (same masks)."""
    rp, kp, fb, q, k, v = paged_batch([6, 25], 3, 8, 2, 8)
    o_ref, _ = run_both(rp, kp, fb, q, k, v)
    tri = make_backend("triton", req_pool=rp, kv_pool=kp)
    fbd = replace(fb, forward_mode=ForwardMode.DECODE)
    o_dec = tri.forward(0, q, k, v, fbd, tri.init_forward_metadata(fbd))
    assert_matches(o_ref, o_dec)


def test_pass_kv_is_written_before_attending():
    """The pass's own K/V land at out_cache_loc before the kernel reads them (token i sees tokens <= i)."""
    rp, kp, fb, q, k, v = paged_batch([4], 4, 8, 2, 8)
    tri = make_backend("triton", req_pool=rp, kv_pool=kp)
    tri.forward(0, q, k, v, fb, tri.init_forward_metadata(fb))
    torch.testing.assert_close(kp.k[0][fb.out_cache_loc], k, rtol=0, atol=0)
    torch.testing.assert_close(kp.v[0][fb.out_cache_loc], v, rtol=0, atol=0)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prefixes=st.lists(st.integers(1, 56), min_size=1, max_size=3),
    T=st.integers(1, 6),
    heads=st.sampled_from([(8, 2), (4, 1), (2, 2)]),
    d=st.sampled_from([8, 16]),
    pad=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_extend_matches_reference_property(prefixes, T, heads, d, pad, seed):
    prefixes = [min(p, 64 - T) for p in prefixes]
    o_ref, o_tri = run_both(*paged_batch(prefixes, T, heads[0], heads[1], d, pad_lanes=pad, seed=seed))
    assert_matches(o_ref, o_tri)


@pytest.mark.skipif(INTERPRET, reason="Triton's interpreter computes with numpy, which has no bf16; tests/test_gpu.py covers bf16")
def test_bf16_close_to_reference():
    """bf16: the kernels keep fp32 accumulators where the reference rounds scores and probs to bf16."""
    o_ref, o_tri = run_both(*paged_batch([5, 30], 4, 8, 2, 16, dtype=torch.bfloat16))
    assert_matches(o_ref, o_tri, torch.bfloat16)


def _triton_case(**over):
    from harness.cases.case import parse_case

    data = tomllib.loads((CASES / "tp1_neither.toml").read_text())
    data.update(name="triton_small", backend="triton")
    data["spec"].update(num_steps=2, capture_bs=[1, 2, 4], max_running_requests=4)
    data["schedule"]["batches"] = [[3], [1]]
    for k, v in over.items():
        data[k] = v
    return parse_case(data)


def test_case_runs_on_triton_backend_p1_p3_p4():
    """A whole case (eager + simulated graph, P1/P3/P4) with the triton backend; and its eager rows
    equal the torch backend's rows of the same scenario within the attention tolerance."""
    from harness.pipeline.check import check_case
    from harness.run.case_run import run_spmd

    case = _triton_case()
    rep = check_case(case)
    assert rep.ok, rep.first_failure()
    torch_runs = run_spmd(replace(case.scenario, attention_backend="torch"), runner="eager")
    tol = attn_vs_reference("float32")
    for it, (a, b) in enumerate(zip(rep.runs[0].eager, torch_runs[0].eager, strict=True)):
        for step, (x, y) in enumerate(zip(a, b, strict=True)):
            for name in ("logits", "hidden", "logprobs"):
                torch.testing.assert_close(getattr(x.out, name), getattr(y.out, name), rtol=10 * tol.rtol, atol=10 * tol.atol,
                                           msg=lambda m, it=it, step=step, name=name: f"iteration {it} step {step} {name}: {m}")


def test_case_tp2_attn_tp_gather_on_triton_backend():
    """Two simulated ranks (threads) sharing the interpreter: the launch lock keeps them apart."""
    from harness.pipeline.check import check_case

    case = _triton_case(layout={"tp_size": 2, "moe_dense_tp_size": 1})
    assert case.layout.branch.value == "attn_tp_gather"
    rep = check_case(case)
    assert rep.ok, rep.first_failure()


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's speed-ups apply where the kernels are interpreted (CPU)")
def test_the_runners_kernels_run_with_the_interpreters_speed_ups_and_wrap_int32_as_a_gpu_does():
    """The runners' kernels run in an interpreter sped up as the engine checks' is (runners/attention/triton_interpreter.py),
    and an int32 add still wraps as it does on a GPU (the overflow assertion it skips is the one Triton drops)."""
    assert getattr(interp.TritonSemantic.binary_op_sanitize_overflow_impl, "__specharness_skip__", False)
    assert getattr(interp._get_np_dtype, "__specharness_memo__", False)

    @triton.jit
    def add(x_ptr, out_ptr, k):
        tl.store(out_ptr, tl.load(x_ptr) + k)

    x, out = torch.tensor([2**31 - 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    run_kernel(add, (1,), x, out, 1)
    assert out.tolist() == [-2**31]
