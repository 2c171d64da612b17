"""What the real ranks rest on, without launching one: collective signatures (what a mismatch
message names) and the xdist GPU / port slicing (fake device counts), and the multigpu marker.
"""
from __future__ import annotations

import pytest

from harness.ranks.gpu_slice import (
    SLICE_ENV,
    apply_worker_slice,
    cuda_visible_devices_for_worker,
    gpu_slice,
    port_range,
    require_gpus,
    worker_count,
    worker_gpus,
    worker_index,
)
from harness.ranks.signature import describe_signature, encode_signature, mismatch_message
from harness.ranks.trace import CollectiveCall

# ---------------------------------------------------------------------------------------
# signatures (pure)
# ---------------------------------------------------------------------------------------


def test_signatures_describe_and_compare():
    def call(op, shape, dtype="torch.float32", group="attn_tp", seq=5):
        return CollectiveCall(seq, op, group, (2, 3), shape, dtype)

    ag, rs = call("all_gather", (12, 64)), call("reduce_scatter", (12, 64))
    assert describe_signature(encode_signature(ag)) == ag.describe()
    assert mismatch_message([encode_signature(ag)] * 2, (2, 3)) is None
    msg = mismatch_message([encode_signature(rs), encode_signature(ag)], (2, 3), "attn_tp")
    assert "rank 3 called all_gather(group=attn_tp, shape=(12, 64), dtype=float32)" in msg
    assert "where rank 2 called reduce_scatter(group=attn_tp, shape=(12, 64), dtype=float32)" in msg
    # the majority is the reference: the odd rank out is named, whatever its position
    sigs = [encode_signature(call("all_reduce", (4,), dtype="torch.bfloat16"))] + [encode_signature(call("all_reduce", (4,)))] * 3
    assert mismatch_message(sigs, (0, 1, 2, 3), "world").split(": ", 1)[1].startswith("rank 0 called all_reduce(group=attn_tp, shape=(4,), dtype=bfloat16)")
    # all_gather_v: only trailing dims and lengths count
    v1, v2 = call("all_gather_v", (7, 3)), call("all_gather_v", (9, 3))
    assert mismatch_message([encode_signature(v1, [3, 4]), encode_signature(v2, [3, 4])], (2, 3)) is None
    assert mismatch_message([encode_signature(v1, [3, 4]), encode_signature(v2, [3, 5])], (2, 3)) is not None
    assert mismatch_message([encode_signature(v1, [3, 4]), encode_signature(call("all_gather_v", (7, 4)), [3, 4])], (2, 3))
    assert describe_signature(encode_signature(v1, [3, 4])) == "all_gather_v(group=attn_tp, shape=(7, 3), dtype=float32, lengths=[3, 4])"
    b0, b1 = call("broadcast", (2,)), call("broadcast", (2,))
    assert mismatch_message([encode_signature(b0, [0]), encode_signature(b1, [1])], (2, 3)) is not None
    big = call("all_reduce", tuple(range(1, 11)))  # more dims than the signature spells out: still compared
    assert mismatch_message([encode_signature(big), encode_signature(call("all_reduce", tuple(range(1, 10)) + (11,)))], (2, 3))
    assert describe_signature(encode_signature(call("barrier", (), dtype=""))) == "barrier(group=attn_tp, shape=(), dtype=)"


# ---------------------------------------------------------------------------------------
# xdist slicing (fake device counts)
# ---------------------------------------------------------------------------------------


def test_worker_index_and_count_from_env():
    assert worker_index({}) == 0 and worker_count({}) == 1
    assert worker_index({"PYTEST_XDIST_WORKER": "gw3"}) == 3
    assert worker_index({"PYTEST_XDIST_WORKER": "gw12"}) == 12
    assert worker_index({"PYTEST_XDIST_WORKER": "master"}) == 0
    assert worker_count({"PYTEST_XDIST_WORKER_COUNT": "8"}) == 8
    assert worker_count({"PYTEST_XDIST_WORKER_COUNT": "bogus"}) == 1


def test_port_ranges_are_disjoint():
    ranges = [port_range(w) for w in range(64)]
    seen: set[int] = set()
    for r in ranges:
        assert len(r) > 0 and r.stop <= 65536
        assert seen.isdisjoint(r)
        seen.update(r)
    with pytest.raises(ValueError):
        port_range(10_000)


@pytest.mark.parametrize("device_count", [0, 1, 2, 8])
def test_gpu_slices_partition_the_devices(device_count, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # parent_visible=None reads it; xdist workers have their slice there
    for n_workers in range(1, 17):
        slices = [gpu_slice(w, n_workers, device_count) for w in range(n_workers)]
        flat = [d for s in slices for d in s]
        assert flat == list(range(device_count))  # a partition, in order: contiguous slices
        sizes = [len(s) for s in slices]
        assert max(sizes) - min(sizes) <= 1  # balanced
        if n_workers > device_count:
            assert sizes.count(0) == n_workers - device_count
        for w, s in enumerate(slices):
            assert cuda_visible_devices_for_worker(w, n_workers, device_count, parent_visible=None) == ",".join(map(str, s)) or (
                not s and cuda_visible_devices_for_worker(w, n_workers, device_count, parent_visible=None) == ""
            )
    with pytest.raises(ValueError):
        gpu_slice(2, 2, 8)


def test_gpu_slice_examples_and_skip_reasons():
    assert [gpu_slice(w, 3, 8) for w in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [gpu_slice(w, 4, 2) for w in range(4)] == [[0], [1], [], []]
    assert cuda_visible_devices_for_worker(1, 2, None, parent_visible="4,5,6,7") == "6,7"
    assert cuda_visible_devices_for_worker(3, 4, None, parent_visible="GPU-a,GPU-b") == ""
    env = {"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "4"}
    assert worker_gpus(8, env) == [2, 3]
    assert require_gpus(2, 8, env) is None
    reason = require_gpus(4, 8, env)
    assert reason == "needs 4 GPU(s) in this worker's slice: xdist worker gw1 of 4 has 2 ([2, 3]) of 8 visible"
    assert "has 0 ([])" in require_gpus(1, 0, {})
    env2 = dict(env, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    assert apply_worker_slice(env2) == "2,3" and env2["CUDA_VISIBLE_DEVICES"] == "2,3" and SLICE_ENV in env2
    assert apply_worker_slice(env2) == "2,3"  # idempotent
    assert worker_gpus(2, env2) == [0, 1]  # already sliced: every visible device is this worker's


def test_multigpu_marker_is_enforced_by_conftest(monkeypatch):
    """@pytest.mark.multigpu(n) skips with require_gpus' reason; a malformed marker is a usage error, not a silent run."""
    from conftest import _multigpu_skip_reason
    from harness.ranks import gpu_slice as gs

    monkeypatch.setattr(gs, "_visible_device_count", lambda: 2)
    for var in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", gs.SLICE_ENV):  # the same answer under xdist
        monkeypatch.delenv(var, raising=False)
    assert _multigpu_skip_reason("t::a", pytest.mark.multigpu(2).mark) is None
    assert _multigpu_skip_reason("t::b", pytest.mark.multigpu(4).mark) == "needs 4 GPU(s) in this worker's slice: this process has 2 ([0, 1]) of 2 visible"
    for bad in (pytest.mark.multigpu.mark, pytest.mark.multigpu("2").mark, pytest.mark.multigpu(0).mark):
        with pytest.raises(pytest.UsageError, match="t::c: @pytest.mark.multigpu takes one positive int"):
            _multigpu_skip_reason("t::c", bad)
