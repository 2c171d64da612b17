"""Host mirrors under the recording CPU graph (runners/graph/host.py, runners/graph/record.py): ops on host memory
run at capture only and what they computed is frozen, as a GPU capture leaves host work out of the graph; a device
op may read a 0-dim host tensor (a kernel argument, baked); any other mix of host and device memory is refused."""
import gc

import pytest
import torch

from runners.config import DEFAULT_MODEL, SpecConfig
from runners.decode_cuda_graph_runner import DecodeCudaGraphRunner
from runners.graph.backend import GraphBackend
from runners.graph.host import host_mirror, is_host_mirror
from runners.graph.record import GraphCaptureError, RecordedGraph
from runners.parallel.dp_attention import RankContext
from runners.parallel.layout import ParallelLayout


def _capture(body):
    g = RecordedGraph(body)
    g.capture()
    return g


def test_an_op_on_a_host_mirror_runs_at_capture_only_and_its_value_is_baked():
    mirror = host_mirror(torch.tensor([1, 1, 1, 1]))
    keys = torch.arange(6)

    def body():
        longest = mirror.max()  # host: runs now, never at replay
        return (keys < longest).to(torch.int64)

    g = _capture(body)
    assert g.output.tolist() == [1, 0, 0, 0, 0, 0]
    assert g.num_host_ops == 1 and g.num_ops == 2  # lt (the host scalar baked) and the cast
    mirror.copy_(torch.tensor([4, 2, 3, 1]))
    keys.copy_(torch.arange(6) - 1)  # device input: live at replay
    g.replay()
    assert g.output.tolist() == [1, 1, 0, 0, 0, 0]  # keys live, the bound still 1 (max of the capture-time mirror)


def test_a_device_scalar_in_the_same_body_stays_live():
    """The twin of the test above on device memory: the same ops recorded and replayed, so the bound follows the buffer."""
    lens = torch.tensor([1, 1, 1, 1])
    keys = torch.arange(6)
    g = _capture(lambda: (keys < lens.max()).to(torch.int64))
    lens.copy_(torch.tensor([4, 2, 3, 1]))
    g.replay()
    assert g.output.tolist() == [1, 1, 1, 1, 0, 0]


def test_host_reads_of_a_mirror_are_allowed_under_capture_and_frozen():
    mirror = host_mirror(torch.tensor([2, 3]))
    x = torch.arange(8.0)

    def body():
        n = int(mirror.max())  # .item() of host memory: no device sync
        widths = mirror.tolist()
        return x[: n + widths[0]] * 2

    g = _capture(body)
    assert g.output.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
    mirror.fill_(7)
    x.add_(1)
    g.replay()
    assert g.output.tolist() == [2.0, 4.0, 6.0, 8.0, 10.0]  # the shape of capture time, the device data live


def test_a_host_read_of_device_memory_is_still_refused():
    device = torch.tensor([2, 3])
    with pytest.raises(GraphCaptureError, match="_local_scalar_dense"):
        _capture(lambda: int(device.max()))
    with pytest.raises(GraphCaptureError, match=r"Tensor\.tolist"):
        _capture(lambda: device.tolist())


@pytest.mark.parametrize("what,body", [
    ("reads", lambda m, d: d[:3] + m),  # a host vector in a device op: another device on a GPU
    ("copies", lambda m, d: d[:3].copy_(m)),  # host to device: a pageable copy syncs
    ("writes", lambda m, d: m.copy_(d[:3])),  # device to host
    ("reads", lambda m, d: d[m]),  # a host index
])
def test_other_mixes_of_host_and_device_memory_are_refused_naming_the_op(what, body):
    mirror = host_mirror(torch.tensor([0, 1, 2]))
    device = torch.arange(5)
    with pytest.raises(GraphCaptureError, match=f"aten\\.\\w+\\.\\w+ {what} host memory \\(3,\\)") as err:
        _capture(lambda: body(mirror, device))
    assert "test_host_mirrors.py" in str(err.value)


def test_a_mark_covers_every_view_and_ends_with_the_memory():
    t = torch.arange(6)
    assert not is_host_mirror(t)
    host_mirror(t)
    view = t[2:4]
    assert is_host_mirror(view) and is_host_mirror(t.view(2, 3))
    assert not is_host_mirror(t.clone())
    del t
    gc.collect()
    assert is_host_mirror(view)  # the view holds the memory
    probe = view.untyped_storage().data_ptr()
    del view
    gc.collect()
    again = torch.empty(6, dtype=torch.int64)
    assert again.untyped_storage().data_ptr() != probe or not is_host_mirror(again)


def test_the_runners_mark_their_host_mirrors_and_nothing_else():
    ctx = RankContext(ParallelLayout(), 0, comm=None)  # a metadata-only runner, as P1's
    r = DecodeCudaGraphRunner(ctx, DEFAULT_MODEL, SpecConfig(num_steps=2, capture_bs=(1, 2)), None, GraphBackend("sim"))
    assert all(is_host_mirror(t) for t in (r.seq_lens_cpu, r.custom_mask_cpu, r.chain_mask_cpu, r.get_forward_batch(2).seq_lens_cpu))
    assert not any(is_host_mirror(t) for t in (r.seq_lens, r.custom_mask, r.chain_mask, r.input_ids, r.req_pool_indices))
