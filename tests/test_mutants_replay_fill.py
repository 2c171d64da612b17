"""The replay-fill mutants' machinery: the one-run probes pass on the code as it is (else every mutant they run would
count as killed), and base.keeps undoes exactly the writes it names."""
from types import SimpleNamespace

import pytest
import torch

from harness.mutants import BY_ID, replay_fill
from harness.mutants.base import keeps
from harness.pipeline.mutants import probes

PROBES = {p.id: p for p in probes()}
ONE_RUN_PROBES = ("metadata-dp", "case-tp1", "churn-single-layer", "padded-lanes-multi-layer", "padded-lanes-single-layer")


@pytest.mark.parametrize("name", ONE_RUN_PROBES)
def test_a_one_run_probe_passes_without_a_mutant(name):
    verdicts = PROBES[name].run()
    assert verdicts and all(v.ok and v.checked for v in verdicts.values()), {k: v.first() for k, v in verdicts.items() if not v.ok}


def test_every_replay_fill_mutant_runs_one_run_probes_only():
    cheap = set(ONE_RUN_PROBES)
    assert all(m.probes and set(m.probes) <= cheap for m in replay_fill.MUTANTS)
    assert all(BY_ID[m.id] is m for m in replay_fill.MUTANTS)  # registered in the catalog


def _writer(self, value):
    self.a.fill_(value)
    self.b.fill_(value)
    return value * 2


def test_keeps_undoes_the_named_writes_only_and_returns_the_result():
    runner = SimpleNamespace(a=torch.zeros(3), b=torch.zeros(3), c=None)
    assert keeps(_writer, "a", "c")(runner, 5.0) == 10.0  # c: a buffer this branch lacks (None) is skipped
    assert runner.a.tolist() == [0.0, 0.0, 0.0] and runner.b.tolist() == [5.0, 5.0, 5.0]


def test_keeps_reaches_the_draft_extend_runners_buffer_set():
    buffers = SimpleNamespace(a=torch.ones(2), b=torch.ones(2))
    runner = SimpleNamespace(buffers=buffers, a=torch.ones(2), b=torch.ones(2))
    keeps(lambda self, v: self.buffers.a.fill_(v), "a")(runner, 7.0)
    assert buffers.a.tolist() == [1.0, 1.0]
