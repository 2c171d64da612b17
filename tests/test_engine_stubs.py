"""harness/engines/sglang/stubs.py: the stub tqdm runs the loops it wraps (a capture loop over `tqdm.tqdm(buckets)`)."""
from __future__ import annotations

import importlib.util

from harness.engines.sglang.stubs import StubFinder


def _stub(name: str):
    return importlib.util.module_from_spec(StubFinder(("tqdm",)).find_spec(name))


def test_the_stub_tqdm_iterates_its_iterable_and_absorbs_the_rest():
    tqdm = _stub("tqdm")
    bar = tqdm.tqdm([8, 4, 2])
    seen = []
    for bs in bar:
        seen.append(bs)
        bar.set_description(f"Capturing batches ({bs=})")
    assert seen == [8, 4, 2] and len(bar) == 3
    assert list(tqdm.tqdm(x * x for x in range(3))) == [0, 1, 4]
    assert list(tqdm.trange(2, 5)) == [2, 3, 4]
    with tqdm.tqdm(total=3) as manual:  # no iterable: the manual form
        manual.update(1)
        assert list(manual) == []
    auto = _stub("tqdm.auto")  # `from tqdm.auto import tqdm`
    assert list(auto.tqdm(iter("ab"), desc="x", disable=True)) == ["a", "b"]

    class Sub(tqdm.tqdm):  # still subclassable
        pass

    assert list(Sub([1])) == [1]
