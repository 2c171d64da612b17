"""The single-layer draft decode on the triton backend: its attention against the torch reference, its graph
runner against its eager run, and the refusal of a backend that cannot run it.

The attention of draft step s: lane (b, t) reads request b's prefix (req_to_token row, keys below seq_len)
and its own draft slots of steps 0..s (runners.attention.torch_ref.TorchAttnBackend.init_draft_decode_metadata).
On CPU the kernel runs in Triton's interpreter, an oracle for indexing and masks in fp32.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton_backend = pytest.importorskip("runners.attention.triton_backend", reason="triton is not installed (pip install triton==3.6.0)")

from harness.props.p4 import PROPERTY as P4  # noqa: E402
from harness.props.tolerances import attn_vs_reference, eager_vs_graph  # noqa: E402
from harness.ranks.simulated import SimulatedWorld  # noqa: E402
from runners import attention  # noqa: E402
from runners.attention.torch_ref import TorchAttnBackend  # noqa: E402
from runners.batch import ForwardBatch, ForwardMode  # noqa: E402
from runners.config import ModelConfig, SpecConfig  # noqa: E402
from runners.draft_decode import EagleProposer  # noqa: E402
from runners.draft_extend import SEQ_LEN_FILL_VALUE, DraftWorker  # noqa: E402
from runners.eagle_draft import (  # noqa: E402
    DraftDecodeInputs,
    DraftDecodeSpecInfo,
    assign_draft_cache_locs,
    require_draft_decode,
    run_eager_decode,
)
from runners.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner  # noqa: E402
from runners.graph.backend import GraphBackend  # noqa: E402
from runners.memory import PADDING_ROW, ReqToTokenPool, TokenToKVPool  # noqa: E402
from runners.parallel.dp_attention import RankContext  # noqa: E402
from runners.parallel.layout import ParallelLayout  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MODEL = ModelConfig(num_kv_heads=1)  # one KV head: half the interpreted programs of the default model, GQA group 8
STEPS = 3  # draft slots per lane (num_steps - 1 forwards)


@pytest.fixture(autouse=True)
def _kernels_can_run():
    err = triton_backend.interpreter_error(DEVICE)
    if err is not None:
        pytest.fail(err)


@dataclass
class DraftBatch:
    rp: ReqToTokenPool
    kp: TokenToKVPool
    seq: torch.Tensor  # [bs]
    rows: torch.Tensor  # [bs]
    locs: torch.Tensor  # [bs, topk, STEPS]


def draft_batch(prefixes: list[int], topk: int, hkv: int, d: int, pad_lanes: int, seed: int = 0) -> DraftBatch:
    """Requests with random KV everywhere (prefix and draft slots), then padded lanes as the replay fills them:
    the padding row (every slot the padding slot) and seq_len = the fill value."""
    g = torch.Generator().manual_seed(seed)
    C = 64
    rp = ReqToTokenPool(len(prefixes) + 2, C, DEVICE)
    kp = TokenToKVPool(1, 1 + sum(p + topk * STEPS for p in prefixes) + 8, hkv, d, torch.float32, DEVICE)
    kp.k[0].copy_(torch.randn(kp.k[0].shape, generator=g))
    kp.v[0].copy_(torch.randn(kp.v[0].shape, generator=g))
    rows = []
    for p in prefixes:
        i = rp.alloc()
        s = kp.alloc(p + topk * STEPS)
        rp.req_to_token[i, : len(s)] = torch.tensor(s, device=DEVICE)
        rows.append(i)
    seq = torch.tensor(prefixes + [SEQ_LEN_FILL_VALUE] * pad_lanes, device=DEVICE)
    rows = torch.tensor(rows + [PADDING_ROW] * pad_lanes, device=DEVICE)
    bs = seq.shape[0]
    locs = assign_draft_cache_locs(rp.req_to_token, rows, seq, topk, STEPS, torch.empty(bs * topk * STEPS, dtype=torch.int64, device=DEVICE))
    return DraftBatch(rp, kp, seq, rows, locs.view(bs, topk, STEPS))


def step_batch(b: DraftBatch, step: int) -> ForwardBatch:
    """Draft step `step`: every lane one position past the last (padded lanes from position 0), writing its step-s slot."""
    bs, topk, _ = b.locs.shape
    pad = b.rows == PADDING_ROW
    positions = (torch.where(pad, 0, b.seq) + step).repeat_interleave(topk)
    return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=torch.zeros(bs * topk, dtype=torch.int64, device=DEVICE),
                        positions=positions, seq_lens=b.seq, req_pool_indices=b.rows, out_cache_loc=b.locs[:, :, step].reshape(-1),
                        extend_seq_lens=b.seq[:0], extend_start_loc=b.seq[:0],
                        spec_info=DraftDecodeSpecInfo(torch.ones(bs, topk), torch.zeros(bs, topk, dtype=torch.int64), torch.zeros(bs, 8), topk))


@pytest.mark.parametrize("topk,prefixes,heads", [(1, [5, 40], (8, 2)), (2, [64 - 2 * STEPS, 9], (4, 1))],
                         ids=["topk1-gqa4", "topk2-mqa-full-ctx"])
def test_draft_decode_attention_matches_reference(topk, prefixes, heads):
    """Every step, real lanes and a padded lane (padding row): the triton kernel equals the torch reference in fp32."""
    hq, hkv = heads
    b = draft_batch(prefixes, topk, hkv, 8, pad_lanes=1)
    ref = TorchAttnBackend(b.rp, b.kp)
    tri = triton_backend.TritonAttnBackend(b.rp, b.kp)
    g = torch.Generator().manual_seed(1)
    tol = attn_vs_reference("float32")
    for step in range(STEPS):
        fb = step_batch(b, step)
        n = fb.positions.shape[0]
        q, k, v = (torch.randn(n, h, 8, generator=g).to(DEVICE) for h in (hq, hkv, hkv))
        o_ref = ref.forward(0, q, k, v, fb, ref.init_draft_decode_metadata(fb, b.locs, step))  # writes this step's K/V first
        o_tri = tri.forward(0, q, k, v, fb, tri.init_draft_decode_metadata(fb, b.locs, step))
        torch.testing.assert_close(o_tri.cpu(), o_ref.cpu(), rtol=tol.rtol, atol=tol.atol, msg=lambda m, s=step: f"step {s}: {m} ({tol.reason})")
    real = len(prefixes) * topk
    plain = tri.forward(0, q, k, v, fb, tri.init_forward_metadata(fb))  # a plain DECODE: the prefix only (positions < seq_len)
    assert not torch.allclose(plain[:real], o_tri[:real], atol=1e-3), "the draft slots must change what a real lane reads"


def _workers(comm, backend: str, topk: int, capture_bs: tuple[int, ...] = (4,)):
    spec = SpecConfig(num_steps=3, topk=topk, capture_bs=capture_bs, max_running_requests=4, draft="single_layer")
    ctx = RankContext(ParallelLayout(), 0, comm)
    out = []
    for _ in range(2):
        w = DraftWorker(ctx, MODEL, spec, num_layers=1, attention_backend=backend, max_reqs=8, num_slots=512)
        for r in range(1, 8):  # request r owns slots 64r .. 64r + 63
            w.req_pool.req_to_token[r] = torch.arange(r * 64, r * 64 + 64)
        w.kv_pool.k[0].copy_(torch.randn(w.kv_pool.k[0].shape, generator=torch.Generator().manual_seed(2)))
        w.kv_pool.v[0].copy_(torch.randn(w.kv_pool.v[0].shape, generator=torch.Generator().manual_seed(3)))
        out.append(w)
    return out


def _inputs(bs: int, topk: int, seed: int) -> DraftDecodeInputs:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(5, 40, (bs,), generator=g)
    p = torch.rand(bs, topk, generator=g).sort(dim=1, descending=True).values
    return DraftDecodeInputs(p, torch.randint(0, MODEL.vocab_size, (bs, topk), generator=g), torch.randn(bs, MODEL.hidden_size, generator=g),
                             seq, torch.arange(1, bs + 1), seq.repeat_interleave(topk), [bs])


def test_triton_graph_runner_matches_eager():
    """P3-style, topk 2: the runner attends with the worker's triton backend; after a batch of 4, requests 1-3
    replayed in bucket 4 (a padded lane that held request 4) equal the triton eager run: the tree exactly, the
    floats within eager-vs-graph."""
    def fn(comm):
        eager, graph = _workers(comm, "triton", 2)
        runner = EAGLEDraftCudaGraphRunner(graph, GraphBackend("sim"))
        assert runner.attn is graph.attn and runner.attn.name == "triton"
        runner.capture()
        big = _inputs(4, 2, 5)
        run_eager_decode(eager, big), runner.replay(big)
        small = _inputs(3, 2, 6)
        e, g = run_eager_decode(eager, small), runner.replay(small)
        assert runner.backend.stats.replays == 2
        return e.tensors(), g.tensors()

    (e, g), = SimulatedWorld(ParallelLayout()).run(fn)
    tol = eager_vs_graph("cpu", "float32", "triton")
    for name in ("tokens", "parents", "child_index"):
        assert torch.equal(e[name], g[name]), name
    for name in ("scores", "child_p", "step_logits"):
        if tol is None:
            assert torch.equal(e[name], g[name]), name
        else:
            torch.testing.assert_close(g[name], e[name], rtol=tol.rtol, atol=tol.atol)


def test_triton_tree_matches_the_torch_reference():
    """The probe the triton draft-decode mutants die on (P4, triton vs the torch reference, topk 1 and 2, a padding-row
    lane) passes on the real kernel."""
    (probe,) = P4.probes
    out = probe.run()
    assert set(out) == {"P4"} and out["P4"].ok and out["P4"].checked == 12, out


class _ReplanSpy(TorchAttnBackend):
    """A backend that plans on the host (as flashinfer): the graph runner re-plans it before every replay."""

    def __init__(self, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool):
        super().__init__(req_pool, kv_pool)
        self.replans: list[ForwardBatch] = []

    def init_forward_metadata_replay_cuda_graph(self, fb: ForwardBatch) -> None:
        self.replans.append(fb)


def test_decode_runner_replans_its_backend_before_each_replay():
    """The decode runner replays through BaseCudaGraphRunner._replay_graph with the worker's backend: a host-planned
    backend gets init_forward_metadata_replay_cuda_graph with the bucket's capture batch (its buffers hold the live lanes)."""
    def fn(comm):
        _, w = _workers(comm, "torch", 2, capture_bs=(2, 4))
        w.attn = _ReplanSpy(w.req_pool, w.kv_pool)
        runner = EAGLEDraftCudaGraphRunner(w, GraphBackend("sim"))
        runner.capture()
        assert w.attn.replans == []  # capture plans nothing on the host
        runner.replay(_inputs(3, 2, 7))
        runner.replay(_inputs(2, 2, 8))
        assert [fb.batch_size for fb in w.attn.replans] == [4, 2]
        assert all(fb is runner.capture_batches[fb.batch_size] for fb in w.attn.replans)
        return True

    assert SimulatedWorld(ParallelLayout()).run(fn) == [True]


class _NoDraftDecode:
    name = "planless"

    def init_forward_metadata(self, fb):
        raise AssertionError("never reached")


def test_backend_without_draft_decode_is_refused(monkeypatch):
    """Never a fallback to another backend's attention: the proposer and the graph runner refuse it when built."""
    monkeypatch.setitem(attention.BACKENDS, "planless", lambda **kw: _NoDraftDecode())
    with pytest.raises(ValueError, match="'planless' has no init_draft_decode_metadata"):
        require_draft_decode(_NoDraftDecode())

    def fn(comm):
        _, w = _workers(comm, "torch", 1)
        w.attn = _NoDraftDecode()
        with pytest.raises(ValueError, match="planless.*single-layer EAGLE draft decode"):
            EAGLEDraftCudaGraphRunner(w, GraphBackend("sim"))
        with pytest.raises(ValueError, match="planless.*init_draft_decode_metadata"):
            EagleProposer(w.ctx, MODEL, w.spec, ReqToTokenPool(8, 64, DEVICE), 512, "eager", DEVICE, attention_backend="planless",
                          draft="single_layer")
        return True

    assert SimulatedWorld(ParallelLayout()).run(fn) == [True]
