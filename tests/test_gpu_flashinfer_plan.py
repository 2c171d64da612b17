"""flashinfer's replay plan: once per iteration for the multi-layer draft-extend steps of a bucket,
and again whenever what it reads was written; from host lengths (no device read-back) when the
batch carries them; the draft decode's per-step plans.

CPU: the key of what a plan read and where it reads the lengths from, against values written out by
hand (the indptrs and the KV slot list kernel: tests/test_flashinfer_kv_indices.py). GPU (marker `gpu`): the
plan count over real iterations, that a plan kept past a change of the lengths is caught by P3
(flashinfer runs on a GPU only, so the stale-plan break cannot be a CPU mutant), the draft-decode
attention against the torch reference, and the runners' replay plans reading no length back.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from harness.props.p3 import check_eager_vs_graph
from harness.ranks.simulated import SimulatedWorld
from harness.run.scenario import Iteration, RequestSpec, Scenario, materialize, release
from runners.attention import BACKENDS, unavailable_reason
from runners.attention.flashinfer_plan import WrapperSet, plan_inputs_key, plan_sources
from runners.batch import EagleVerifyInput, ForwardMode
from tests.test_gpu import make_case, run_world


def _need_flashinfer() -> None:
    if "flashinfer" not in BACKENDS:
        pytest.skip(f"backend flashinfer: {unavailable_reason('flashinfer')}")


# ---- CPU ----
def test_plan_reads_host_copies_only_when_the_batch_has_all_it_needs():
    seq, host = torch.tensor([5, 6]), torch.tensor([5, 6])
    fb = SimpleNamespace(seq_lens=seq, seq_lens_cpu=host, spec_info=None)
    assert plan_sources(fb)[0] is host and plan_sources(fb)[1] is None
    mask, host_mask = torch.ones(2, 3, 3, dtype=torch.bool).tril(), torch.ones(2, 3, 3, dtype=torch.bool).tril()
    fb.spec_info = EagleVerifyInput(3, mask)  # a verify batch without a host mask: both from the device, in one read
    assert plan_sources(fb)[0] is seq and plan_sources(fb)[1] is mask
    fb.spec_info = EagleVerifyInput(3, mask, host_mask)
    assert plan_sources(fb)[0] is host and plan_sources(fb)[1] is host_mask
    fb.seq_lens_cpu = None
    assert plan_sources(fb)[0] is seq and plan_sources(fb)[1] is mask


def _batch(seq_buf: torch.Tensor, rpi_buf: torch.Tensor, bs: int, mode=ForwardMode.DRAFT_EXTEND_V2):
    return SimpleNamespace(forward_mode=mode, batch_size=bs, seq_lens=seq_buf[:bs], req_pool_indices=rpi_buf[:bs],
                           extend_seq_lens_cpu=[4] * bs, spec_info=None)


def test_plan_key_changes_with_every_write_the_plan_reads_and_only_those():
    seq, rpi, r2t, ids = torch.full((8,), 1), torch.zeros(8, dtype=torch.int64), torch.zeros(9, 16, dtype=torch.int64), torch.zeros(32)
    fb = _batch(seq, rpi, 4)
    key = plan_inputs_key(fb, r2t, 8)
    assert key == plan_inputs_key(_batch(seq, rpi, 4), r2t, 8)  # a new view of unwritten buffers
    ids.fill_(3)  # a chain input (the next step's token ids): the plan does not read it
    assert plan_inputs_key(fb, r2t, 8) == key
    writes = (
        lambda: seq.fill_(1),  # the reset writes the same values: still a write
        lambda: seq[6:].copy_(torch.tensor([9, 9])),  # through another view, past the bucket: the storage was written
        lambda: rpi[:2].copy_(torch.tensor([1, 2])),
        lambda: r2t[3, :5].copy_(torch.arange(5)),  # the scheduler's rows
    )
    for write in writes:
        before = plan_inputs_key(fb, r2t, 8)
        write()
        assert plan_inputs_key(fb, r2t, 8) != before
    assert plan_inputs_key(_batch(seq, rpi, 2), r2t, 8) != plan_inputs_key(fb, r2t, 8)  # another bucket
    assert plan_inputs_key(_batch(seq, rpi, 4, ForwardMode.TARGET_VERIFY), r2t, 8) != plan_inputs_key(fb, r2t, 8)
    assert plan_inputs_key(_batch(seq.clone(), rpi, 4), r2t, 8) != plan_inputs_key(fb, r2t, 8)  # another buffer set


def test_plan_key_of_an_inference_tensor_is_unknown():
    with torch.inference_mode():
        seq = torch.ones(4, dtype=torch.int64)
    assert plan_inputs_key(_batch(seq, torch.zeros(4, dtype=torch.int64), 4), torch.zeros(2, 8, dtype=torch.int64), 8) is None


# ---- GPU ----
@pytest.mark.gpu
def test_flashinfer_plans_once_per_multi_layer_iteration():
    """3 draft layers, one bucket: each iteration plans its wrapper once (at step 0) and skips
    the other two steps' plans; the next iteration's fill plans again."""
    _need_flashinfer()
    from runners.config import ModelConfig, SpecConfig
    from runners.draft_extend import DraftWorker
    from runners.draft_extend_graph_driver import DraftExtendGraphDriver
    from runners.graph.backend import GraphBackend
    from runners.parallel.dp_attention import RankContext
    from runners.parallel.layout import ParallelLayout

    layout = ParallelLayout()
    model = ModelConfig(hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=1024, dtype="bfloat16")
    spec = SpecConfig(num_steps=3, capture_bs=(4,), max_running_requests=4)
    device = torch.device("cuda")

    def fn(comm):
        worker = DraftWorker(RankContext(layout, 0, comm), model, spec, attention_backend="flashinfer", device=device,
                             max_reqs=12, num_slots=1 + 8 * (16 + 4) + 64)
        driver = DraftExtendGraphDriver(worker, GraphBackend("cuda", device))
        driver.capture()
        entry = worker.attn._wrappers[(WrapperSet.GRAPH, "prefill", 4)]
        counts = []
        for it, bs in enumerate((3, 4, 3)):
            reqs = tuple(RequestSpec(100 * it + i, 5 + 3 * i + it, 1 + i % 4) for i in range(bs))
            sc = Scenario(model, spec, layout, (Iteration((reqs,)),), seed=0, attention_backend="flashinfer", name=f"plan-{it}")
            batch = materialize(worker, sc, sc.iterations[0])
            before = (entry.plans, entry.replans_skipped)
            driver.run(batch.inputs)
            counts.append((entry.plans - before[0], entry.replans_skipped - before[1]))
            release(worker, batch)
        return counts

    assert SimulatedWorld(layout, timeout_s=600).run(fn)[0] == [(1, 2)] * 3


@pytest.mark.gpu
def test_flashinfer_stale_plan_is_caught(monkeypatch):
    """A key blind to writes keeps the first plan of a bucket for good: the bucket's later
    iterations (other requests, other lengths) replay it, and P3 must fail."""
    _need_flashinfer()
    from runners.attention import flashinfer_backend

    monkeypatch.setattr(flashinfer_backend, "plan_inputs_key", lambda fb, req_to_token, heads: (fb.forward_mode, fb.batch_size))
    case = make_case("tp1", "flashinfer", "bfloat16", "hd64", batches=([3], [4], [3]))
    runs = run_world(case.scenario, "cuda", "cuda")
    assert not check_eager_vs_graph(case.scenario, runs, "cuda").ok


@pytest.mark.gpu
def test_flashinfer_kv_indices_left_out_of_the_graph_are_caught(monkeypatch):
    """The kv_indices kernel belongs in the graph: captured without it, every replay attends through the slot list
    the graph's warm-up left (the capture batch's rows, not the live requests'), and P3 must fail."""
    _need_flashinfer()
    from runners.attention import flashinfer_backend

    real = flashinfer_backend.write_kv_indices
    monkeypatch.setattr(flashinfer_backend, "write_kv_indices",
                        lambda *a, **k: None if torch.cuda.is_current_stream_capturing() else real(*a, **k))
    case = make_case("tp1", "flashinfer", "bfloat16", "hd64", batches=([3], [4], [3]))
    runs = run_world(case.scenario, "cuda", "cuda")
    assert not check_eager_vs_graph(case.scenario, runs, "cuda").ok


@pytest.mark.gpu
def test_flashinfer_graph_matches_eager_over_one_bucket_reused():
    """The same schedule unbroken: P3 holds, so the test above fails for the stale plan alone."""
    _need_flashinfer()
    case = make_case("tp1", "flashinfer", "bfloat16", "hd64", batches=([3], [4], [3]))
    runs = run_world(case.scenario, "cuda", "cuda")
    assert check_eager_vs_graph(case.scenario, runs, "cuda").ok


@pytest.mark.gpu
def test_flashinfer_verify_graph_runs_chains_and_refuses_a_tree_at_its_replay_plan():
    """The verify graph hands flashinfer every batch's mask: a chain replays (the causal plan is
    its mask), a tree filled into the same buffers is refused by the replay plan, not run causal."""
    _need_flashinfer()
    from harness.bench.runners import build_rig, rig_spec
    from runners.config import ModelConfig
    from runners.parallel.layout import ParallelLayout
    from runners.target import Lane

    layout = ParallelLayout()
    model = ModelConfig(hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=1024, dtype="bfloat16")

    def fn(comm):
        rig = build_rig(comm, model, rig_spec((1, 2, 4)), "flashinfer", torch.device("cuda"), "cuda", layout, runners=("verify",))
        batch = rig.batch(2, 1000)
        lanes = rig.verify_lanes(batch, seed=0)
        out = rig.verify.replay(rig.verify_inputs(lanes))
        torch.cuda.synchronize()
        assert torch.isfinite(out.logits).all()
        tree = [Lane(lane.req_pool_idx, lane.start, lane.tokens, [-1, 0, 0, 1]) for lane in lanes]  # node 2 branches off the root
        with pytest.raises(NotImplementedError, match="tree mask"):
            rig.verify.replay(rig.verify_inputs(tree))
        release(rig.worker, batch)
        return True

    assert SimulatedWorld(layout, timeout_s=600).run(fn)[0]


def test_plan_key_of_a_verify_batch_reads_its_mask_buffer():
    seq, rpi, r2t = torch.full((4,), 1), torch.zeros(4, dtype=torch.int64), torch.zeros(5, 16, dtype=torch.int64)
    mask = torch.ones(4, 4, 4, dtype=torch.bool).tril()
    fb = _batch(seq, rpi, 4, ForwardMode.TARGET_VERIFY)
    fb.spec_info = EagleVerifyInput(4, mask)
    before = plan_inputs_key(fb, r2t, 8)
    mask[1, 2, 1].fill_(False)  # a tree written into the graph's mask buffer: the plan must see it
    assert plan_inputs_key(fb, r2t, 8) != before


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("topk", [1, 2])
def test_flashinfer_draft_decode_attention_matches_the_reference(dtype, topk):
    """Every step of a draft decode (3 requests and a padded lane: row 0, seq_len 1) eagerly, flashinfer against the
    torch reference on the same cache; with the host lengths no plan reads them back, without them each step's does."""
    _need_flashinfer()
    from harness.props.tolerances import attn_vs_reference
    from runners.attention import make_backend
    from runners.attention.torch_ref import TorchAttnBackend
    from runners.batch import ForwardBatch
    from runners.eagle_draft import DraftDecodeSpecInfo, assign_draft_cache_locs
    from tests.test_gpu import _paged

    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    prefixes, steps, live = [5, 40, 17], 3, 3 * topk
    rp, kp, fb0, *_ = _paged(prefixes, topk * steps, 8, 2, 64, tdt, pad_lanes=1, mode=ForwardMode.DECODE)
    dev, bs, n = fb0.seq_lens.device, 4, 4 * topk
    seq = torch.tensor(prefixes + [1], device=dev)
    rpi = fb0.req_pool_indices
    locs = assign_draft_cache_locs(rp.req_to_token, rpi, seq, topk, steps, torch.empty(n * steps, dtype=torch.int64, device=dev))
    locs = locs.view(bs, topk, steps)
    g = torch.Generator().manual_seed(3)
    ref = TorchAttnBackend(rp, kp)
    tol = attn_vs_reference(dtype, "flashinfer")
    for host in (True, False):
        fi = make_backend("flashinfer", req_pool=rp, kv_pool=kp)
        for step in range(steps):
            fb = ForwardBatch(ForwardMode.DECODE, bs, torch.zeros(n, dtype=torch.int64, device=dev), (seq + step).repeat_interleave(topk),
                              seq, rpi, locs[:, :, step].reshape(n), seq[:0], seq[:0],
                              DraftDecodeSpecInfo(torch.ones(bs, topk, device=dev), torch.zeros(bs, topk, dtype=torch.int64, device=dev),
                                                  torch.zeros(bs, 8, device=dev), topk),
                              seq_lens_cpu=seq.cpu() if host else None)
            q, k, v = (torch.randn(n, h, 64, generator=g).to(tdt).to(dev) for h in (8, 2, 2))
            o_ref = ref.forward(0, q, k, v, fb, ref.init_draft_decode_metadata(fb, locs, step))
            o = fi.forward(0, q, k, v, fb, fi.init_draft_decode_metadata(fb, locs, step))
            torch.testing.assert_close(o[:live].float(), o_ref[:live].float(), rtol=tol.rtol, atol=tol.atol,
                                       msg=lambda m, step=step: f"step {step}: {m}\n({tol.reason})")
            assert torch.isfinite(o).all()
        assert fi.readbacks == (0 if host else steps)


@pytest.mark.gpu
def test_flashinfer_replay_plans_read_no_length_back_from_the_device():
    """The rig's three runners (single-layer draft-extend, draft decode, verify) replayed with the host copies the
    scheduler keeps: every replay plan reads the runners' host mirrors, never the device."""
    _need_flashinfer()
    from harness.bench.runners import build_rig, rig_spec
    from runners.config import ModelConfig
    from runners.parallel.layout import ParallelLayout

    layout = ParallelLayout()
    model = ModelConfig(hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=1024, dtype="bfloat16")

    def fn(comm):
        rig = build_rig(comm, model, rig_spec((1, 2, 4), topk=2), "flashinfer", torch.device("cuda"), "cuda", layout)
        draft, target = rig.worker.attn, rig.target.attn
        before = (draft.readbacks, target.readbacks, sum(e.plans for e in draft._wrappers.values()))
        batch = rig.batch(3, 1000)
        rig.extend.run(batch.inputs)
        rig.decode.replay(rig.decode_inputs(batch, seed=0))
        rig.verify.replay(rig.verify_inputs(rig.verify_lanes(batch, seed=0)))
        torch.cuda.synchronize()
        release(rig.worker, batch)
        return before, (draft.readbacks, target.readbacks, sum(e.plans for e in draft._wrappers.values()))

    (rb_draft, rb_target, plans), after = SimulatedWorld(layout, timeout_s=600).run(fn)[0]
    assert after[:2] == (rb_draft, rb_target)
    assert after[2] == plans + 1 + 2  # the draft-extend's plan and the draft decode's two steps: the replays did plan


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_flashinfer_replay_plan_attends_as_its_own_plan(mode):
    """The replay plan (flashinfer's planner alone over the buffers the backend wrote) against flashinfer's own plan of
    the same batch: the same output, bitwise; another plan in between (shorter lengths) changes it, so the replay plan
    is what restores it."""
    _need_flashinfer()
    from dataclasses import replace

    from runners.attention import make_backend
    from tests.test_gpu import _paged

    fm = ForwardMode.DECODE if mode == "decode" else ForwardMode.DRAFT_EXTEND_V2
    T = 1 if mode == "decode" else 4
    rp, kp, fb, q, k, v = _paged([5, 40, 17, 59], T, 8, 2, 64, torch.bfloat16, mode=fm)
    fb = replace(fb, seq_lens_cpu=fb.seq_lens.cpu())
    fi = make_backend("flashinfer", req_pool=rp, kv_pool=kp)
    fi.init_forward_metadata_capture_cuda_graph(fb)  # a bucket's batch: its pass plans the graph wrapper, as a warm-up
    own = fi.forward(0, q, k, v, fb, fi.init_forward_metadata(fb))  # flashinfer's own plan
    entry = fi._entry(WrapperSet.GRAPH, fi._kind(fb), fb.batch_size)
    kv = (kp.k[0].unsqueeze(1), kp.v[0].unsqueeze(1))
    shorter = replace(fb, seq_lens_cpu=fb.seq_lens_cpu - 3)
    fi.plan_replay(shorter)
    assert not torch.equal(entry.wrapper.run(q, kv), own)
    fi.plan_replay(fb)
    assert torch.equal(entry.wrapper.run(q, kv), own)
    assert entry.plans == 3 and fi.readbacks == 0
