"""The flashinfer plan's host half and the device kernel that writes the KV slot list from it, on CPU:
`kv_index_plan` (every step's indptrs, in the staging buffer it is given) and `write_kv_indices` (one
Triton kernel per wrapper, here in Triton's interpreter), against slot lists written out by hand and a
lane-by-lane loop over req_to_token and the draft slots; the backend's refusal of a plan whose staged
lengths were overwritten before their upload. The kernel inside a real graph, and a graph
captured without it caught by P3: tests/test_gpu_flashinfer_plan.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from runners.attention.flashinfer_backend import FlashInferAttnBackend, _Group, _PlanArgs, _Wrapper
from runners.attention.flashinfer_kv_indices import write_kv_indices
from runners.attention.flashinfer_plan import WrapperSet, kv_index_plan
from runners.attention.triton_launch import interpreter_error


@pytest.fixture
def _kernel_runs():
    err = interpreter_error(torch.device("cpu"))
    if err is not None:
        pytest.fail(err)


def _written(plan, req_to_token: torch.Tensor, rpi: torch.Tensor, steps: int, cap: int, per_req: int = 1,
             own: torch.Tensor | None = None, only: tuple[int, ...] | None = None) -> torch.Tensor:
    """What the device does with a plan: each step's kernel (a draft decode's step s reads its first s + 1 own slots)
    writes that step's kv_indices from the step's indptr, as the pass's first layer launches it."""
    kv_indices = torch.full((steps, cap), -1, dtype=torch.int32)
    for s in range(steps) if only is None else only:
        write_kv_indices(plan.kv_indptr(s).clone(), rpi, req_to_token, kv_indices[s], per_req, own, 0 if own is None else s + 1)
    return kv_indices


ROWS = torch.arange(60).view(6, 10) + 100  # req_to_token: row r, position p -> slot 100 + 10 r + p


def test_kv_indices_concatenate_each_requests_first_slots(_kernel_runs):
    plan = kv_index_plan([4, 1, 2], [2, 1, 4], 10, cap=30)
    assert plan.qo_indptr().tolist() == [0, 4, 5, 7]
    assert plan.kv_indptr(0).tolist() == [0, 2, 3, 7]
    assert plan.kv_lens.tolist() == [[2, 1, 4]] and plan.totals == [7] and plan.qo_rows == 7
    got = _written(plan, ROWS, torch.tensor([3, 0, 5]), 1, 30)
    assert got[0, :7].tolist() == [130, 131, 100, 150, 151, 152, 153]
    assert (got[0, 7:] == -1).all()  # nothing past the plan's slots is written


def test_kv_index_plan_of_no_request_is_empty(_kernel_runs):
    plan = kv_index_plan([], [], 4, cap=0)
    assert plan.kv_indptr(0).tolist() == [0] and plan.totals == [0]
    assert _written(plan, ROWS, torch.zeros(0, dtype=torch.int64), 1, 0).numel() == 0


def test_draft_decode_kv_indices_end_with_the_steps_own_slots(_kernel_runs):
    locs = torch.tensor([[7, 8, 9], [4, 5, 6]])  # each lane's draft slots of steps 0..2
    plan = kv_index_plan([1, 1], [2, 1], 10, cap=9, steps=3, draft_slots=3)
    got = _written(plan, ROWS, torch.tensor([3, 0]), 3, 9, own=locs)
    assert got[0, :5].tolist() == [130, 131, 7, 100, 4]
    assert got[1, :7].tolist() == [130, 131, 7, 8, 100, 4, 5]
    assert got[2].tolist() == [130, 131, 7, 8, 9, 100, 4, 5, 6]
    assert [plan.kv_indptr(s).tolist() for s in range(3)] == [[0, 3, 5], [0, 4, 7], [0, 5, 9]]


def test_a_steps_kernel_writes_its_row_only(_kernel_runs):
    locs = torch.tensor([[7, 8, 9], [4, 5, 6]])
    plan = kv_index_plan([1, 1], [2, 1], 10, cap=12, steps=3, draft_slots=3)
    got = _written(plan, ROWS, torch.tensor([3, 0]), 3, 12, own=locs, only=(1,))
    assert got[1, :7].tolist() == [130, 131, 7, 8, 100, 4, 5] and (got[1, 7:] == -1).all()
    assert (got[0] == -1).all() and (got[2] == -1).all()


@pytest.mark.parametrize("topk", [1, 2])
def test_kv_indices_match_the_slots_read_one_by_one(_kernel_runs, topk):
    """Random rows, lengths and draft slots, rows longer than the kernel's block: every step's kv_indices as a loop over
    req_to_token and the slot list reads them, lane by lane (the keys the torch reference masks in, in order)."""
    g = torch.Generator().manual_seed(5)
    reqs, width, steps = 5, 300, 3
    req_to_token = torch.randperm(10000, generator=g)[: 8 * width].view(8, width)
    rpi = torch.randperm(8, generator=g)[:reqs]
    seq = torch.randint(0, width + 1, (reqs,), generator=g).tolist()
    locs = torch.randint(10000, 20000, (reqs, topk, steps), generator=g)
    prefix = [s for s in seq for _ in range(topk)]
    cap = reqs * topk * (width + steps)
    plan = kv_index_plan([1] * len(prefix), prefix, width, cap, steps, steps)
    got = _written(plan, req_to_token, rpi, steps, cap, topk, locs.reshape(-1, steps))
    for s in range(steps):
        want = []
        for b in range(reqs):
            for t in range(topk):
                want += req_to_token[rpi[b], : seq[b]].tolist() + locs[b, t, : s + 1].tolist()
        assert got[s, : len(want)].tolist() == want and plan.totals[s] == len(want)
        assert (got[s, len(want):] == -1).all()


def test_kv_index_plan_writes_the_staging_buffer_it_is_given():
    staging = torch.full((12,), -7, dtype=torch.int32)
    plan = kv_index_plan([1, 1], [2, 1], 10, cap=12, steps=3, draft_slots=3, out=staging)
    assert plan.packed.data_ptr() == staging.data_ptr()
    assert staging[:12].tolist() == [0, 1, 2, 0, 3, 5, 0, 4, 7, 0, 5, 9]
    with pytest.raises(ValueError, match="host int32 buffer of 12"):
        kv_index_plan([1, 1], [2, 1], 10, cap=12, steps=3, draft_slots=3, out=torch.zeros(11, dtype=torch.int32))
    with pytest.raises(ValueError, match="host int32 buffer"):
        kv_index_plan([1, 1], [2, 1], 10, cap=12, steps=3, draft_slots=3, out=torch.zeros(12, dtype=torch.int64))


def test_kv_index_plan_refuses_what_its_buffers_cannot_hold():
    with pytest.raises(ValueError, match="buffer holds"):
        kv_index_plan([1, 1], [5, 6], 10, cap=10)
    with pytest.raises(ValueError, match="outside a request row"):
        kv_index_plan([1], [11], 10, cap=100)
    with pytest.raises(ValueError, match="steps"):
        kv_index_plan([1], [2], 10, cap=100, steps=4, draft_slots=3)
    with pytest.raises(ValueError, match="query lengths"):
        kv_index_plan([1, 1, 1], [2, 2], 10, cap=100)


def test_write_kv_indices_refuses_draft_slots_that_do_not_fit_the_lanes():
    indptr, out = torch.tensor([0, 3, 6], dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match="draft slots"):
        write_kv_indices(indptr, torch.tensor([0]), ROWS, out, 2, torch.zeros(3, 3, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="no slot buffer"):
        write_kv_indices(indptr, torch.tensor([0]), ROWS, out, 2, None, 1)


def test_a_plan_whose_staged_lengths_were_overwritten_is_refused():
    """Two plans of one wrapper group staged before the first is uploaded: the first would upload the second's
    lengths, so its upload is refused (the backend's guard, driven on CPU: it runs before any flashinfer call)."""
    backend = FlashInferAttnBackend.__new__(FlashInferAttnBackend)  # no CUDA here: only the staging path runs
    event = SimpleNamespace(synchronize=lambda: None, record=lambda: None)
    group = _Group("prefill", WrapperSet.GRAPH, 2, 1, 10, torch.zeros(6, dtype=torch.int32), torch.zeros(1, 10, dtype=torch.int32),
                   torch.zeros(6, dtype=torch.int32), event)
    first = _PlanArgs(kv_index_plan([1, 1], [2, 3], 10, 10, out=backend._staging(group)), group.staged)
    second = _PlanArgs(kv_index_plan([1, 1], [4, 5], 10, 10, out=backend._staging(group)), group.staged)
    entry = _Wrapper(group, 0, wrapper=None)
    with pytest.raises(RuntimeError, match="overwritten in the staging buffer"):
        backend._plan(entry, first, 8, replay=True)
    assert group.meta.tolist() == [0] * 6  # nothing uploaded
    with pytest.raises(RuntimeError, match="never planned"):  # the second uploads, then needs a warmed-up wrapper
        backend._plan(entry, second, 8, replay=True)
    assert group.meta.tolist() == [0, 1, 2, 0, 4, 9]
