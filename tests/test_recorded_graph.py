"""The CPU graph records ops at capture and replays the record (runners/graph/record.py):
capture refuses host reads as a CUDA capture does, replay runs no Python of the body, outputs
are overwritten in place, views of static buffers alias them, host values are frozen, and
collectives and Triton launches are recorded like any other op."""
import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():  # as tests/test_triton_backend.py: before triton's first import
    os.environ.setdefault("TRITON_INTERPRET", "1")

from harness.cases.case import load_case  # noqa: E402
from harness.props.outputs import compare_outputs  # noqa: E402
from harness.props.tolerances import cross_device  # noqa: E402
from harness.ranks.simulated import SimulatedWorld  # noqa: E402
from harness.run.rig import run_rank  # noqa: E402
from harness.verdict import Verdict  # noqa: E402
from runners.graph.backend import GraphBackend  # noqa: E402
from runners.graph.record import (
    GraphCaptureError,  # noqa: E402
    RecordedGraph,  # noqa: E402
)
from runners.parallel.comm import Group  # noqa: E402
from runners.parallel.layout import ParallelLayout  # noqa: E402


def _capture(body):
    g = RecordedGraph(body)
    g.capture()
    return g


def _line_of(fn, marker: str) -> int:
    """The line of `fn` whose source contains `marker` (so the test does not hard-code line numbers)."""
    import inspect

    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, text in enumerate(lines) if marker in text)


# ---- capture-time guards ----

def test_int_of_a_device_value_fails_capture_naming_the_op_and_the_line():
    t = torch.arange(4.0)

    def body():
        s = t * 2
        return int(s.sum())  # the host read

    with pytest.raises(GraphCaptureError) as err:
        _capture(body)
    msg = str(err.value)
    assert "aten._local_scalar_dense" in msg
    assert f"test_recorded_graph.py:{_line_of(body, 'the host read')}" in msg
    assert "int(s.sum())" in msg  # the source line is quoted


HOST_READS = {
    "item": (lambda t: t.sum().item(), "aten._local_scalar_dense"),
    "bool": (lambda t: bool(t[0] > 0), "aten._local_scalar_dense"),
    "tolist": (lambda t: t.tolist(), "Tensor.tolist()"),
    "numpy": (lambda t: t.numpy(), "Tensor.numpy()"),
    "cpu": (lambda t: t.cpu(), "Tensor.cpu()"),
    "nonzero": (lambda t: t.nonzero(), "aten.nonzero"),
    "unique": (lambda t: t.unique(), "aten._unique2"),
    "bool-mask-index": (lambda t: t[t > 1], "aten.index.Tensor with a boolean mask"),
    "bool-mask-put-many": (lambda t: t.clone().index_put_((t > 1,), torch.tensor([7.0, 8.0])), "aten.index_put_"),
}


@pytest.mark.parametrize("name", list(HOST_READS))
def test_host_reads_and_data_dependent_shapes_fail_capture(name):
    read, op = HOST_READS[name]
    t = torch.arange(4.0)
    with pytest.raises(GraphCaptureError, match="graph capture: ") as err:
        _capture(lambda: read(t))
    assert op in str(err.value)
    assert "test_recorded_graph.py:" in str(err.value)


def test_static_shape_ops_capture_and_host_reads_work_again_after_capture():
    """An integer gather, a masked fill and a one-value masked put are static: no sync on a GPU either."""
    t, idx = torch.arange(6.0), torch.tensor([4, 0, 2])

    def body():
        return t[idx] + t.masked_fill(t > 3, 0.0)[:3] + t.clone().index_put_((t > 4,), torch.tensor(1.0))[:3]

    g = _capture(body)
    t.copy_(torch.arange(6.0) * 10)
    g.replay()
    assert g.output.tolist() == [40.0, 1.0, 21.0]
    assert t.tolist()  # the guard is gone after capture


# ---- replay semantics ----

def test_replay_runs_no_python_of_the_body():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    calls = []

    def helper(a):
        return torch.relu(a @ w)

    def body():
        calls.append(1)
        return helper(x) + 1

    g = _capture(body)
    assert calls == [1]
    seen = []
    sys.setprofile(lambda frame, event, arg: seen.append(frame.f_code) if event == "call" else None)
    try:
        for _ in range(3):
            x.normal_()
            g.replay()
    finally:
        sys.setprofile(None)
    assert calls == [1]
    assert body.__code__ not in seen and helper.__code__ not in seen
    torch.testing.assert_close(g.output, torch.relu(x @ w) + 1, rtol=0, atol=0)  # yet the result follows the live input


def test_host_values_are_frozen_at_capture():
    """What a re-run of the body would get wrong: a Python value read during capture is baked in."""
    class Runner:
        scale = 2.0

    r, x = Runner(), torch.ones(3)
    g = _capture(lambda: x * r.scale + len(r.__dict__))
    r.scale = 5.0
    x.fill_(3.0)
    g.replay()
    assert g.output.tolist() == [6.0, 6.0, 6.0]  # x is live, the scale is the capture-time 2.0


def test_captured_outputs_are_overwritten_in_place():
    x = torch.zeros(4)

    def body():
        y = torch.exp(x)
        vals, idx = torch.topk(y * torch.arange(4.0), 2)
        return y, vals, idx

    g = _capture(body)
    y, vals, idx = g.output
    ptrs = [t.data_ptr() for t in g.output]
    held = y[1:3]  # a consumer holding a view of an output
    x.copy_(torch.tensor([0.0, 1.0, 2.0, -5.0]))
    g.replay()
    assert [t.data_ptr() for t in g.output] == ptrs and g.output[0] is y
    torch.testing.assert_close(held, torch.exp(torch.tensor([1.0, 2.0])), rtol=0, atol=0)
    assert idx.tolist() == [2, 1]


def test_views_of_static_buffers_alias_them_at_every_replay():
    buf, src = torch.zeros(6), torch.ones(2)

    def body():
        buf[1:3].copy_(src * 2)  # a view of a static buffer made during capture, written through
        tail = buf[3:]
        tail.add_(1)  # an in-place op on another capture-time view
        return buf[:3]  # an output that is a view of the static buffer

    g = _capture(body)
    assert buf.tolist() == [0, 2, 2, 1, 1, 1]
    src.fill_(5)
    g.replay()
    assert buf.tolist() == [0, 10, 10, 2, 2, 2]
    assert g.output.data_ptr() == buf.data_ptr() and g.output.tolist() == [0, 10, 10]


def test_intermediates_are_a_private_pool_reused_across_replays():
    x = torch.randn(5, 5)
    g = _capture(lambda: (x @ x).softmax(-1).sum(0))
    assert g.num_ops >= 3 and "aten.mm.out" in g.op_counts()  # out-of-place ops replay into their captured outputs
    first = g.output.data_ptr()
    for _ in range(2):
        x.normal_()
        g.replay()
        assert g.output.data_ptr() == first
    torch.testing.assert_close(g.output, (x @ x).softmax(-1).sum(0), rtol=0, atol=0)


def test_backend_makes_recorded_graphs_on_cpu():
    x = torch.ones(2)
    gb = GraphBackend("sim")
    g = gb.capture(lambda: x + 1)
    assert isinstance(g, RecordedGraph) and g.num_ops == 1
    x.fill_(4)
    gb.replay(g)
    assert g.output.tolist() == [5.0, 5.0] and gb.stats.replays == 1


# ---- collectives and custom ops ----

def test_collectives_are_recorded_and_reissued_in_order_on_every_rank():
    layout = ParallelLayout(tp_size=2)

    def rank(comm):
        x = torch.full((2,), float(comm.rank + 1))
        g = _capture(lambda: comm.all_gather(comm.all_reduce(x, Group.WORLD) * 2, Group.WORLD))
        after_capture = g.output.clone()
        x.mul_(10)
        g.replay()
        g.replay()
        return after_capture, g.output.clone(), g.op_counts()

    world = SimulatedWorld(layout, timeout_s=30)
    results = world.run(rank)
    for after_capture, after_replay, counts in results:
        assert after_capture.tolist() == [6.0] * 4  # (1 + 2) * 2, gathered
        assert after_replay.tolist() == [60.0] * 4
        assert counts["specharness.collective.default"] == 2
    for trace in world.traces:  # capture + two replays, each re-issuing both collectives in order
        assert [c.op for c in trace] == ["all_reduce", "all_gather"] * 3


def test_triton_launch_is_a_recorded_op():
    from runners.attention import BACKENDS, unavailable_reason

    if "triton" not in BACKENDS:
        pytest.skip(unavailable_reason("triton"))
    from runners.attention.triton_backend import interpreter_error

    if interpreter_error(torch.device("cpu")):
        pytest.skip(interpreter_error(torch.device("cpu")))
    from harness.run.scenario import Iteration, RequestSpec, Scenario
    from runners.config import ModelConfig, SpecConfig
    from runners.draft_extend import DraftWorker
    from runners.draft_extend_graph_driver import DraftExtendGraphDriver
    from runners.parallel.dp_attention import RankContext

    spec = SpecConfig(num_steps=1, capture_bs=(2,), max_running_requests=2)
    sc = Scenario(ModelConfig(), spec, ParallelLayout(), (Iteration(((RequestSpec(0, 3, 1),),)),), attention_backend="triton")

    def rank(comm):
        w = DraftWorker(RankContext(sc.layout, 0, comm), sc.model, sc.spec, attention_backend="triton")
        d = DraftExtendGraphDriver(w, GraphBackend("sim"))
        d.capture()
        return d.runners[0].graphs[2].op_counts()

    counts = SimulatedWorld(sc.layout).run(rank)[0]
    assert counts.get("specharness.triton_attention.default") == 1


# ---- the recorded CPU graph against a real CUDA graph ----

@pytest.mark.gpu
def test_recorded_cpu_graph_agrees_with_the_real_cuda_graph():
    """One case, graph runners only: the CPU recording and torch.cuda.CUDAGraph on the GPU. Host
    metadata and replay records exactly; outputs within the cross-device tolerance. World size 1:
    simulated ranks are threads, and their host-side collectives would not be in a CUDA graph
    that several threads capture (test_gpu.py runs larger worlds with the recorded graph only)."""
    sc = load_case("tp1_neither").scenario

    def world(kind: str, device: str):
        return SimulatedWorld(sc.layout, timeout_s=900).run(
            lambda comm: run_rank(comm, sc, runner="graph", graph_kind=kind, device=device))

    real, cpu = world("cuda", "cuda"), world("sim", "cpu")
    v = Verdict("recorded-vs-cuda")
    tol = cross_device(sc.model.dtype)
    for a, b in zip(real, cpu, strict=True):
        assert [[r.capture.host for r in recs] for recs in a.records] == [[r.capture.host for r in recs] for recs in b.records]
        assert [[(r.bs, r.rows_fed, r.global_num_tokens_for_logprob_gpu) for r in recs] for recs in a.records] == \
            [[(r.bs, r.rows_fed, r.global_num_tokens_for_logprob_gpu) for r in recs] for recs in b.records]
        for it, (xa, xb) in enumerate(zip(a.graph, b.graph, strict=True)):
            for step, (sa, sb) in enumerate(zip(xa, xb, strict=True)):
                compare_outputs(v, "recorded-vs-cuda", {"rank": a.rank, "iteration": it, "step": step}, sa.out.tensors(), sb.out.tensors(), tol)
    assert v.ok, v.first()


def test_recording_is_true_only_inside_a_capture_on_this_thread():
    from runners.graph.record import recording

    seen = []
    g = _capture(lambda: seen.append(recording()) or torch.ones(1) + 1)
    g.replay()
    assert seen == [True] and not recording()
