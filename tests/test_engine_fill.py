"""harness/engines/sglang/fill.py: the interpreted fill's memo replays a launch's exact effect, and only on the exact same state."""
from __future__ import annotations

import numpy as np
import torch

from harness.engines.sglang.fill import FillMemo, FillObserver


class Launcher:
    """A deterministic fill in the shape of the engine's: writes into its tensor arguments, returns None.
    dst[:n] = src[:n] + bias; dst[n:] keeps what it held; seq_lens[:] = n."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, dst, src, seq_lens, n, bias=0):
        self.runs += 1
        dst[:n] = src[:n] + bias
        seq_lens.fill_(n)


def _state(dst=(9, 9, 9, 9), src=(1, 2, 3, 4), seq_lens=(0, 0)):
    return torch.tensor(dst), torch.tensor(src), torch.tensor(seq_lens, dtype=torch.int32)


def test_a_repeated_launch_on_equal_inputs_writes_the_first_ones_effect_without_running():
    memo, fill = FillMemo(), Launcher()
    dst, src, sl = _state()
    memo.call(fill, (dst, src, sl, 2), {"bias": 10})
    assert dst.tolist() == [11, 12, 9, 9] and sl.tolist() == [2, 2] and fill.runs == 1
    dst2, src2, sl2 = _state()  # other tensors, equal contents
    assert memo.call(fill, (dst2, src2, sl2, 2), {"bias": 10}) is None
    assert fill.runs == 1 and memo.hits == 1
    assert dst2.tolist() == [11, 12, 9, 9] and sl2.tolist() == [2, 2]  # as the launcher would have left them
    assert src2.tolist() == [1, 2, 3, 4]


def test_any_difference_in_the_state_runs_the_launcher():
    memo, fill = FillMemo(), Launcher()
    memo.call(fill, (*_state(), 2), {})
    dst, src, sl = _state(dst=(9, 9, 9, 7))  # a byte the launch never writes but leaves in place
    memo.call(fill, (dst, src, sl, 2), {})
    assert fill.runs == 2 and dst.tolist() == [1, 2, 9, 7]
    memo.call(fill, (*_state(), 3), {})  # a scalar
    memo.call(fill, (*_state(), 2), {"bias": 1})  # a keyword
    memo.call(fill, (*_state(seq_lens=(0, 0, 0)), 2), {})  # a shape
    dst, src, sl = _state()
    memo.call(fill, (dst[1:], src, sl, 2), {})  # a view at another offset of the same bytes
    assert dst.tolist() == [9, 1, 2, 9]
    assert fill.runs == 6 and memo.hits == 0


def test_shared_storage_between_arguments_is_part_of_the_key():
    memo, fill = FillMemo(), Launcher()
    a, b = torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 3, 4])
    memo.call(fill, (a, b, torch.zeros(2, dtype=torch.int32), 2), {"bias": 1})
    assert a.tolist() == [2, 3, 3, 4]
    c = torch.tensor([1, 2, 3, 4])
    memo.call(fill, (c, c, torch.zeros(2, dtype=torch.int32), 2), {"bias": 1})  # the same bytes, but dst is src
    assert fill.runs == 2 and c.tolist() == [2, 3, 3, 4]


def test_a_launcher_that_returns_something_or_takes_an_unknown_argument_is_never_replayed():
    memo = FillMemo()
    runs = []

    def returning(x):
        runs.append(1)
        return x.sum()

    for _ in range(2):
        assert int(memo.call(returning, (torch.ones(3),), {})) == 3
    fill = Launcher()
    for _ in range(2):
        memo.call(fill, (*_state(), 2), {"bias": np.int64(0)})  # not a tensor nor a plain scalar
    assert len(runs) == 2 and fill.runs == 2 and memo.hits == 0


def test_the_observer_counts_every_kernel_launch_and_runs_the_native_twin_each_time():
    twin_runs = []

    def native(dst, src, seq_lens, n, bias=0):
        twin_runs.append(n)
        seq_lens.fill_(n)

    fill = Launcher()
    obs = FillObserver(fill, native)
    for _ in range(3):
        obs(*_state(), 2)
    assert obs.kernel_calls == 3 and fill.runs == 1 and twin_runs == [2, 2, 2]
    assert obs.last_native["seq_lens"] == [2, 2]
