"""The torch_planned backend (runners/attention/torch_planned.py): flashinfer's host-planned shape in torch ops.

Its kernels read only what the host plan uploaded (indptrs) and the request rows, so against the torch reference
(which reads lengths and positions on the device) they agree exactly when the plan is right; under the recording
CPU graph a replay reads what the replay plan wrote, and nothing if it was not planned; a graph wrapper keeps the
rows of its first plan, as flashinfer's cuda-graph mode does, and eager passes plan wrappers of their own."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness.props.tolerances import attn_vs_reference
from runners.attention import make_backend
from runners.attention.flashinfer_plan import WrapperSet
from runners.attention.kinds import TREE_MASK_UNSUPPORTED
from runners.attention.torch_ref import TorchAttnBackend
from runners.batch import EagleVerifyInput, ForwardMode
from runners.eagle_draft import DraftDecodeSpecInfo
from runners.graph.record import RecordedGraph
from runners.verify import tree_mask
from tests.helpers.paged_batch import paged_batch


def _both(rp, kp, fb, q, k, v):
    ref, planned = TorchAttnBackend(rp, kp), make_backend("torch_planned", req_pool=rp, kv_pool=kp)
    o_ref = ref.forward(0, q, k, v, fb, ref.init_forward_metadata(fb))
    return o_ref, planned, planned.forward(0, q, k, v, fb, planned.init_forward_metadata(fb))


@pytest.mark.parametrize("prefixes,T,hq,hkv,d,pad", [
    ([5, 40, 17], 4, 8, 2, 8, 0),  # the default model's heads, GQA 4
    ([1, 60], 4, 4, 4, 16, 0),  # the second request fills max_context_len (64)
    ([7, 20], 4, 8, 2, 8, 2),  # two padded lanes (seq_len 1 < T rows: planned with T keys)
], ids=["gqa4", "full-ctx", "padded"])
def test_an_eager_pass_equals_the_reference_bitwise(prefixes, T, hq, hkv, d, pad):
    rp, kp, fb, q, k, v = paged_batch(prefixes, T, hq, hkv, d, pad_lanes=pad)
    o_ref, planned, o = _both(rp, kp, replace(fb, seq_lens_cpu=fb.seq_lens.clone()), q, k, v)
    real = len(prefixes) * T
    torch.testing.assert_close(o[:real], o_ref[:real], rtol=0, atol=0)  # the same keys, the same softmax
    assert torch.isfinite(o).all()  # a padded lane's rows see at least one key
    assert planned.readbacks == 0  # the host copy was there


def test_a_decode_pass_and_a_batch_without_host_copies_read_back():
    rp, kp, fb, q, k, v = paged_batch([3, 50, 11], 1, 8, 2, 8, mode=ForwardMode.DECODE)
    o_ref, planned, o = _both(rp, kp, fb, q, k, v)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    assert planned.readbacks == 1  # no seq_lens_cpu: the lengths were read from the device (a sync on a GPU)


def test_a_tree_verify_is_refused_at_the_plan():
    rp, kp, fb, q, k, v = paged_batch([5], 3, 8, 2, 8, mode=ForwardMode.TARGET_VERIFY)
    tree = tree_mask([-1, 0, 0])[None]  # the root's two children: not a chain
    fb = replace(fb, spec_info=EagleVerifyInput(3, tree, tree))
    with pytest.raises(NotImplementedError, match=TREE_MASK_UNSUPPORTED[:40]):
        make_backend("torch_planned", req_pool=rp, kv_pool=kp).init_forward_metadata(fb)


def _graph_rig():
    """A bucket of 2 lanes as a graph runner holds it (static buffers, a host mirror), captured after one warm-up."""
    rp, kp, fb, q, k, v = paged_batch([9, 30], 4, 8, 2, 8)
    fb = replace(fb, seq_lens_cpu=fb.seq_lens.clone())
    attn = make_backend("torch_planned", req_pool=rp, kv_pool=kp)
    attn.init_forward_metadata_capture_cuda_graph(fb)

    def body():
        return attn.forward(0, q, k, v, fb, attn.init_forward_metadata(fb))

    body()  # the warm-up plans the graph wrapper
    g = RecordedGraph(body)
    g.capture()
    return rp, kp, fb, q, k, v, attn, g


def _live(rp, kp, fb, q, k, v, prefixes):
    """The buffers rewritten with a new live batch (other lengths), as a replay's copy-in does; the reference output."""
    T = 4
    for lane, p in enumerate(prefixes):
        fb.seq_lens[lane] = fb.seq_lens_cpu[lane] = p + T
        fb.positions[lane * T: (lane + 1) * T] = torch.arange(p, p + T)
        row = int(fb.req_pool_indices[lane])
        fb.out_cache_loc[lane * T: (lane + 1) * T] = rp.req_to_token[row, p: p + T]
    ref = TorchAttnBackend(rp, kp)
    return ref.forward(0, q, k, v, fb, ref.init_forward_metadata(fb))


def test_a_replay_reads_what_the_replay_plan_wrote():
    rp, kp, fb, q, k, v, attn, g = _graph_rig()
    o_ref = _live(rp, kp, fb, q, k, v, [20, 3])
    attn.init_forward_metadata_replay_cuda_graph(fb)
    g.replay()
    torch.testing.assert_close(g.output, o_ref, rtol=0, atol=0)
    o_ref = _live(rp, kp, fb, q, k, v, [12, 25])
    g.replay()  # not planned: the kernels read the last plan's indptrs
    assert not torch.equal(g.output, o_ref)
    attn.init_forward_metadata_replay_cuda_graph(fb)
    g.replay()
    torch.testing.assert_close(g.output, o_ref, rtol=0, atol=0)


def test_a_replay_plan_of_unwritten_inputs_is_skipped():
    rp, kp, fb, q, k, v, attn, g = _graph_rig()
    _live(rp, kp, fb, q, k, v, [20, 3])
    attn.init_forward_metadata_replay_cuda_graph(fb)
    (w,) = [w for w in attn._wrappers.values() if w.wrappers is WrapperSet.GRAPH]
    plans = w.plans
    attn.init_forward_metadata_replay_cuda_graph(fb)  # nothing written since: skipped, as a multi-layer step's
    assert (w.plans, w.replans_skipped) == (plans, 1)
    fb.seq_lens_cpu[0] = 21  # a write to what the plan reads
    attn.init_forward_metadata_replay_cuda_graph(fb)
    assert w.plans == plans + 1


def test_a_graph_wrapper_keeps_its_first_rows_and_eager_passes_plan_their_own():
    rp, kp, fb, q, k, v, attn, _ = _graph_rig()  # the bucket's wrapper: 2 lanes, 8 rows planned at the warm-up
    lens = torch.tensor([15, 36])
    prompt = replace(fb, forward_mode=ForwardMode.EXTEND, input_ids=torch.zeros(12, dtype=torch.int64), extend_seq_lens_cpu=[6, 6],
                     seq_lens=lens, seq_lens_cpu=lens.clone())  # a prefill of 2 requests, 6 rows each
    assert attn.init_forward_metadata(prompt).wrapper.wrappers is WrapperSet.EAGER  # no runner named it: any rows
    attn.graph_batches.add(prompt)  # as if eager passes shared the bucket's wrappers: flashinfer's refusal
    with pytest.raises(ValueError, match="rows in qo_indptr 12 in cuda graph mode cannot exceed the number of rows set during initialization 8"):
        attn.init_forward_metadata(prompt)


def test_capture_and_replay_of_a_batch_no_runner_named_are_refused():
    rp, kp, fb, q, k, v = paged_batch([9], 4, 8, 2, 8)
    attn = make_backend("torch_planned", req_pool=rp, kv_pool=kp)
    attn.forward(0, q, k, v, fb, attn.init_forward_metadata(fb))
    with pytest.raises(RuntimeError, match="no graph runner named"):
        RecordedGraph(lambda: attn.forward(0, q, k, v, fb, attn.init_forward_metadata(fb))).capture()
    with pytest.raises(RuntimeError, match="no graph runner captured with"):
        attn.init_forward_metadata_replay_cuda_graph(fb)


def test_the_draft_decode_plans_every_step_once_and_reads_the_references_keys():
    rp, kp, fb, q, k, v = paged_batch([6, 21], 1, 8, 2, 8, mode=ForwardMode.DECODE)
    bs, topk, steps = 2, 2, 2  # 8 draft slots: what the pool has left
    locs = torch.tensor(kp.alloc(bs * topk * steps)).view(bs, topk, steps)
    n = bs * topk
    qd = torch.randn(n, 8, 8, generator=torch.Generator().manual_seed(3))
    ref, planned = TorchAttnBackend(rp, kp), make_backend("torch_planned", req_pool=rp, kv_pool=kp)
    info = DraftDecodeSpecInfo(torch.zeros(bs, topk), torch.zeros(bs, topk, dtype=torch.int64), torch.zeros(bs, 8), topk)
    fb = replace(fb, spec_info=info, seq_lens_cpu=fb.seq_lens.clone())
    tol = attn_vs_reference("float32")  # the same keys, laid out in another order (the reference puts the draft slots last)
    for step in range(steps):
        step_fb = replace(fb, out_cache_loc=locs[:, :, step].reshape(-1))
        kd, vd = torch.randn(n, 2, 8), torch.randn(n, 2, 8)
        o_ref = ref.forward(0, qd, kd, vd, step_fb, ref.init_draft_decode_metadata(step_fb, locs, step))
        meta = planned.init_draft_decode_metadata(step_fb, locs, step)
        torch.testing.assert_close(planned.forward(0, qd, kd, vd, step_fb, meta), o_ref, rtol=tol.rtol, atol=tol.atol)
    assert meta.wrapper.plans == 1  # one plan of every step's indptrs, at step 0
