"""The multi-layer draft-extend prepare's fused Triton fill (runners.draft_extend_fill) against its native twin.

On CPU the kernel runs in Triton's interpreter: one tiny case against values written out by hand, then
the runner's PrepareFill.TRITON path against its PrepareFill.NATIVE path (reset_for_iteration and
_copy_live_inputs, what the CPU suite and the mutants run) on buffers holding distinct stale garbage,
over buckets, layouts (no gathered counts, (1,), (dp,)), dtypes and a shrinking batch; every buffer
must come out bitwise equal. The same comparison on CUDA, where the runner picks the kernel itself,
is the GPU-marked test at the end.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():  # before triton's first import, as triton_launch does
    os.environ.setdefault("TRITON_INTERPRET", "1")

from runners.attention.triton_launch import interpreter_error  # noqa: E402
from runners.config import ModelConfig, SpecConfig  # noqa: E402
from runners.draft_extend import DraftExtendInputs, DraftWorker  # noqa: E402
from runners.draft_extend_cuda_graph_runner import DraftExtendInputBuffers  # noqa: E402
from runners.draft_extend_fill import fill_prepare_buffers  # noqa: E402
from runners.graph.backend import GraphBackend  # noqa: E402
from runners.memory import LanePadding  # noqa: E402
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import (
    MultiLayerEagleDraftExtendCudaGraphRunner,  # noqa: E402
    PrepareFill,  # noqa: E402
)
from runners.parallel.dp_attention import RankContext  # noqa: E402
from runners.parallel.layout import ParallelLayout as PL  # noqa: E402

DEVICE_BUFFERS = ("input_ids", "positions", "out_cache_loc", "seq_lens", "req_pool_indices", "num_correct_drafts",
                  "num_accept_tokens", "hidden_states", "global_num_tokens_gpu", "global_num_tokens_for_logprob_gpu")
ALL_BUFFERS = DEVICE_BUFFERS + ("seq_lens_cpu",)
SGLANG_PAD = LanePadding(row=0, slot=0)  # SGLang's padding row and dummy slot
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.fixture
def _kernel_runs():
    err = interpreter_error(torch.device("cpu"))
    if err is not None:
        pytest.skip(err)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Compared as raw bits: NaN payloads and -0.0 must survive, and torch.equal calls NaN unequal to itself."""
    return t.view(_BITS[t.element_size()]) if t.is_floating_point() else t


def _assert_same(native, fused, names=ALL_BUFFERS, what="") -> None:
    for name in names:
        a, b = getattr(native, name), getattr(fused, name)
        if a is None or b is None:
            assert a is None and b is None, f"{name}: present in one path only {what}"
            continue
        assert a.dtype == b.dtype and torch.equal(_bits(a).cpu(), _bits(b).cpu()), \
            f"{name} differs {what}:\nnative {a.flatten()[:48].tolist()}\nfused  {b.flatten()[:48].tolist()}"


# ---- by hand: max_bs 4, T 2, hidden 2, gathered (2,) ----

def _tiny_buffers() -> DraftExtendInputBuffers:
    i64 = torch.int64
    return DraftExtendInputBuffers(
        input_ids=torch.tensor([91, 92, 93, 94, 95, 96, 97, 98], dtype=i64),
        positions=torch.tensor([81, 82, 83, 84, 85, 86, 87, 88], dtype=i64),
        out_cache_loc=torch.tensor([71, 72, 73, 74, 75, 76, 77, 78], dtype=i64),
        seq_lens=torch.tensor([61, 62, 63, 64], dtype=i64),
        seq_lens_cpu=torch.tensor([51, 52, 53, 54], dtype=i64),
        req_pool_indices=torch.tensor([41, 42, 43, 44], dtype=i64),
        num_correct_drafts=torch.tensor([1, 0, 1, 0], dtype=i64),
        num_accept_tokens=torch.tensor([2, 1, 2, 1], dtype=i64),
        extend_seq_lens=torch.tensor([2, 2, 2, 2], dtype=i64),
        extend_start_loc=torch.tensor([0, 2, 4, 6], dtype=i64),
        hidden_states=torch.full((8, 2), -7.5),
        next_token_logits_buffer=torch.zeros(0, 4),
        global_num_tokens_gpu=torch.tensor([33, 34], dtype=torch.int32),
        global_num_tokens_for_logprob_gpu=torch.tensor([35, 36], dtype=torch.int32),
    )


def test_tiny_fill_written_by_hand(_kernel_runs):
    """Two live requests in bucket 3: live rows copied, the rest of the token rows 0 and every out_cache_loc the
    padding slot 0, padded lanes seq_len 1 and request row 0, accept counts and hidden rows past the live ones
    untouched, both gathered counts 3 * 2."""
    b = _tiny_buffers()
    hidden = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    inp = DraftExtendInputs(
        input_ids=torch.tensor([11, 12, 13, 14]), positions=torch.tensor([5, 6, 20, 21]), seq_lens=torch.tensor([7, 22]),
        req_pool_indices=torch.tensor([3, 9]), hidden_states=hidden, accept_lens=torch.tensor([2, 1]), dp_batch_sizes=[2, 3],
    )
    fill_prepare_buffers(b, inp, bs=3, tokens_per_bs=2, pad=SGLANG_PAD)
    assert b.input_ids.tolist() == [11, 12, 13, 14, 0, 0, 0, 0]
    assert b.positions.tolist() == [5, 6, 20, 21, 0, 0, 0, 0]
    assert b.out_cache_loc.tolist() == [0] * 8
    assert b.seq_lens.tolist() == [7, 22, 1, 1]
    assert b.req_pool_indices.tolist() == [3, 9, 0, 0]
    assert b.num_correct_drafts.tolist() == [1, 0, 1, 0]  # live: accept - 1 = 1, 0; padded lanes keep 1, 0
    assert b.num_accept_tokens.tolist() == [2, 1, 2, 1]
    assert b.hidden_states.tolist() == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]] + [[-7.5, -7.5]] * 4
    assert b.global_num_tokens_gpu.tolist() == [6, 6] and b.global_num_tokens_for_logprob_gpu.tolist() == [6, 6]
    assert b.seq_lens_cpu.tolist() == [51, 52, 53, 54]  # a host tensor: the runner's to write, not the kernel's
    assert b.extend_seq_lens.tolist() == [2, 2, 2, 2] and b.extend_start_loc.tolist() == [0, 2, 4, 6]


def test_tiny_fill_of_an_idle_rank_by_hand(_kernel_runs):
    """No live request (a DP rank replaying its group's bucket): every lane padded, nothing read from the batch."""
    b = _tiny_buffers()
    inp = DraftExtendInputs(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                            torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64), [0, 4])
    fill_prepare_buffers(b, inp, bs=4, tokens_per_bs=2, pad=SGLANG_PAD)
    assert b.input_ids.tolist() == b.positions.tolist() == b.out_cache_loc.tolist() == [0] * 8
    assert b.seq_lens.tolist() == [1, 1, 1, 1] and b.req_pool_indices.tolist() == [0, 0, 0, 0]
    assert b.num_correct_drafts.tolist() == [1, 0, 1, 0] and b.num_accept_tokens.tolist() == [2, 1, 2, 1]
    assert b.hidden_states.tolist() == [[-7.5, -7.5]] * 8
    assert b.global_num_tokens_gpu.tolist() == [8, 8] and b.global_num_tokens_for_logprob_gpu.tolist() == [8, 8]


@pytest.mark.parametrize("raw_bs,bs,bad", [(3, 2, "bucket"), (2, 5, "bucket"), (2, 3, "input_ids"), (2, 3, "hidden_states")])
def test_fill_refuses_a_batch_the_buffers_cannot_hold(raw_bs, bs, bad, _kernel_runs):
    n = raw_bs * 2
    inp = DraftExtendInputs(torch.arange(n + (bad == "input_ids")), torch.arange(n), torch.ones(raw_bs, dtype=torch.int64),
                            torch.ones(raw_bs, dtype=torch.int64), torch.zeros(n, 2 + (bad == "hidden_states")),
                            torch.ones(raw_bs, dtype=torch.int64), [raw_bs])
    with pytest.raises(ValueError, match="input_ids|hidden_states" if bad != "bucket" else "bucket"):
        fill_prepare_buffers(_tiny_buffers(), inp, bs=bs, tokens_per_bs=2, pad=SGLANG_PAD)


# ---- the runner's two paths, compared ----

def _runner(layout: PL, spec: SpecConfig, model: ModelConfig, device: str, fill: Optional[PrepareFill]):
    """fill=None keeps the path the runner chose for its device."""
    w = DraftWorker(RankContext(layout, 0, comm=None), model, spec, device=device, build_model=False)
    r = MultiLayerEagleDraftExtendCudaGraphRunner(w, 0, GraphBackend("sim"))
    if fill is not None:
        r.prepare_fill = fill
    return r


def _fill_with_garbage(runners, seed: int) -> None:
    """The same distinct garbage in both runners' buffers: per-buffer ranges (a value in the wrong buffer shows),
    and accept counts kept in range, as the native reset leaves them (P2 checks the padded lanes' stay so)."""
    g = torch.Generator().manual_seed(seed)
    for k, name in enumerate(ALL_BUFFERS):
        t = getattr(runners[0], name)
        if t is None:
            continue
        if t.is_floating_point():
            garbage = torch.randn(t.shape, generator=g).to(t.dtype) * (k + 1)
        elif name in ("num_correct_drafts", "num_accept_tokens"):
            garbage = torch.randint(0 if name == "num_correct_drafts" else 1, 3, t.shape, generator=g)
        else:
            garbage = torch.randint(1000 * (k + 1), 1000 * (k + 1) + 999, t.shape, generator=g)
        for r in runners:
            getattr(r, name).copy_(garbage.to(getattr(r, name).dtype))


def _batch(raw_bs: int, T: int, hidden: int, dtype: torch.dtype, dp_sizes: list[int], seed: int, device: str) -> DraftExtendInputs:
    g = torch.Generator().manual_seed(seed)
    n = raw_bs * T
    h = torch.randn(n, hidden, generator=g).to(dtype)
    if n:
        h[0, 0], h[-1, -1] = float("nan"), -0.0  # bits a lossy copy would change
    seq = torch.randint(T, 60, (raw_bs,), generator=g)
    return DraftExtendInputs(
        input_ids=torch.randint(0, 500, (n,), generator=g).to(device),
        positions=torch.randint(0, 60, (n,), generator=g).to(device),
        seq_lens=seq.to(device),
        req_pool_indices=torch.randperm(raw_bs + 5, generator=g)[:raw_bs].add(1).to(device),
        hidden_states=h.to(device),
        accept_lens=torch.randint(1, T + 1, (raw_bs,), generator=g).to(device),
        dp_batch_sizes=dp_sizes,
        seq_lens_cpu=seq,
    )


SMALL = SpecConfig(num_steps=3, capture_bs=(1, 2, 4, 8), max_running_requests=8)  # T 4, max_bs 8
WIDE = SpecConfig(num_steps=1, capture_bs=(1, 4, 160), max_running_requests=160)  # T 2, 320 token rows
LONG = SpecConfig(num_steps=3, capture_bs=(1, 2, 160), max_running_requests=160)  # T 4, 640 rows: two token blocks
MLP, ATTN = PL(4, 2, True), PL(4, moe_dense_tp_size=1)  # gathered (dp,) = (2,); gathered (1,), buckets [4, 8]
# (id, layout, spec, hidden, dtype, schedule: each iteration's (raw_bs, every DP group's bs) and the bucket it must get)
CASES = [
    ("neither-shrink-f32", PL(1), SMALL, 64, "float32", [((7, None), 8), ((3, None), 4), ((1, None), 1)]),
    ("neither-full-bf16", PL(1), SMALL, 48, "bfloat16", [((8, None), 8), ((2, None), 2), ((5, None), 8)]),
    ("attn-gather-bf16", ATTN, SMALL, 24, "bfloat16", [((6, None), 8), ((1, None), 4), ((4, None), 4)]),
    ("mlp-gather-idle-f32", MLP, SMALL, 64, "float32", [((5, [5, 2]), 8), ((0, [0, 3]), 4), ((2, [2, 2]), 2)]),
    ("mlp-gather-bf16", MLP, SMALL, 48, "bfloat16", [((0, [0, 8]), 8), ((3, [3, 1]), 4)]),
    ("wide-bucket-f32", PL(1), WIDE, 64, "float32", [((150, None), 160), ((3, None), 4)]),
    ("long-rows-bf16", MLP, LONG, 64, "bfloat16", [((159, [159, 4]), 160), ((2, [2, 0]), 2)]),
]


def _compare(layout, spec, hidden, dtype, schedule, device, fused_fill: Optional[PrepareFill]):
    model = ModelConfig(hidden_size=hidden, dtype=dtype)
    native, fused = (_runner(layout, spec, model, device, f) for f in (PrepareFill.NATIVE, fused_fill))
    assert native.prepare_fill is PrepareFill.NATIVE and fused.prepare_fill is PrepareFill.TRITON
    _fill_with_garbage((native, fused), seed=hidden)
    for it, ((raw_bs, dp_sizes), want_bs) in enumerate(schedule):
        inp = _batch(raw_bs, native.T, hidden, model.torch_dtype, dp_sizes or [raw_bs], seed=it, device=device)
        got = (native.prepare_replay(inp), fused.prepare_replay(inp))
        assert got == (want_bs, want_bs), f"iteration {it}: buckets {got}, want {want_bs}"
        _assert_same(native, fused, what=f"after iteration {it} (raw_bs {raw_bs}, bucket {want_bs})")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fused_fill_matches_the_native_fill_on_cpu(case, _kernel_runs):
    _, layout, spec, hidden, dtype, schedule = case
    _compare(layout, spec, hidden, dtype, schedule, "cpu", PrepareFill.TRITON)


def test_a_changed_write_in_the_native_path_is_seen():
    """The comparison can fail: a native path whose reset keeps the stale token rows (the
    stale-padded-tokens-after-shrink mutant's break) differs from the kernel's after a shrink."""
    model = ModelConfig(dtype="float32")
    native, other = (_runner(PL(1), SMALL, model, "cpu", PrepareFill.NATIVE) for _ in range(2))
    native.prepare_replay(_batch(7, 4, 64, torch.float32, [7], 0, "cpu"))
    other.prepare_replay(_batch(7, 4, 64, torch.float32, [7], 0, "cpu"))
    other.reset_for_iteration = lambda raw_bs, accept_lens: None  # the instance only: the class keeps the real reset
    shrunk = _batch(2, 4, 64, torch.float32, [2], 1, "cpu")
    native.prepare_replay(shrunk)
    other.prepare_replay(shrunk)
    with pytest.raises(AssertionError, match="input_ids differs"):
        _assert_same(native, other)


def test_the_path_follows_the_device():
    """A CPU runner keeps the native methods (the suite and the mutants patch them); CUDA takes the kernel."""
    assert PrepareFill.for_device("cpu") is PrepareFill.NATIVE and PrepareFill.for_device(torch.device("cuda", 1)) is PrepareFill.TRITON
    w = DraftWorker(RankContext(PL(1), 0, comm=None), ModelConfig(), SMALL, build_model=False)
    assert MultiLayerEagleDraftExtendCudaGraphRunner(w, 0, GraphBackend("sim")).prepare_fill is PrepareFill.NATIVE


def test_the_fused_path_skips_the_native_methods(_kernel_runs):
    """PrepareFill.TRITON writes the buffers without the torch methods: a break planted in them is not run."""
    r = _runner(PL(1), SMALL, ModelConfig(), "cpu", PrepareFill.TRITON)

    def planted(*args):
        raise AssertionError("native method ran on the fused path")

    r.reset_for_iteration = r._copy_live_inputs = planted
    assert r.prepare_replay(_batch(3, 4, 64, torch.float32, [3], 0, "cpu")) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fused_fill_matches_the_native_fill_on_cuda(case):
    """On CUDA the runner picks the kernel by itself (fill=None); the native twin pinned, on the same device."""
    _, layout, spec, hidden, dtype, schedule = case
    _compare(layout, spec, hidden, dtype, schedule, "cuda", None)

