"""The graph runners hand back views of their graph's outputs, as the engine's replays do (runners.outputs): the
next replay of the same graph overwrites what a caller kept, on the recorded CPU graph as on a CUDA graph, and
`cloned()` is how a caller keeps them. The multi-layer driver keeps each step's logits itself: its steps share one
logits buffer."""
from __future__ import annotations

import pytest
import torch

from harness.bench.runners import build_rig, rig_spec
from harness.cases.case import load_case
from harness.ranks.simulated import SimulatedWorld
from harness.run.scenario import materialize, release
from runners.config import ModelConfig
from runners.parallel.layout import ParallelLayout
from tests.helpers.case_driver import captured_driver

MODEL = ModelConfig(hidden_size=64, num_heads=8, num_kv_heads=2, intermediate_size=128, vocab_size=512, max_context_len=64)


def _replay(rig, runner: str, batch, seed: int):
    if runner == "decode":
        return rig.decode.replay(rig.decode_inputs(batch, seed))
    if runner == "verify":
        return rig.verify.replay(rig.verify_inputs(rig.verify_lanes(batch, seed)))
    (out,) = rig.extend.run(batch.inputs)
    return out


GRAPHS = [pytest.param("cpu", "sim", id="recorded-cpu-graph"), pytest.param("cuda", "cuda", id="cuda-graph", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device,graph_kind", GRAPHS)
@pytest.mark.parametrize("runner", ["extend", "decode", "verify"])
def test_the_next_replay_overwrites_the_outputs_a_replay_returned(runner, device, graph_kind):
    def fn(comm):
        rig = build_rig(comm, MODEL, rig_spec((2, 4)), "torch", torch.device(device), graph_kind, runners=(runner,))
        batch = rig.batch(3, 1000)
        first = _replay(rig, runner, batch, seed=1)
        kept = first.cloned()
        release(rig.worker, batch)
        batch = rig.batch(3, 2000)
        second = _replay(rig, runner, batch, seed=2)
        release(rig.worker, batch)
        return first, kept, second

    first, kept, second = SimulatedWorld(ParallelLayout()).run(fn)[0]
    assert first.logits.data_ptr() == second.logits.data_ptr(), "a replay's outputs are views of the graph's own"
    assert torch.equal(first.logits, second.logits), "the second replay wrote the first's outputs in place"
    assert not torch.equal(kept.logits, second.logits), "the copy kept the first replay's logits (other inputs, other logits)"
    assert kept.logits.data_ptr() != first.logits.data_ptr()


def test_the_multi_layer_driver_keeps_every_steps_logits_past_the_next_step():
    sc = load_case("tp1_neither").scenario

    def fn(comm):
        driver = captured_driver(comm, sc)
        batch = materialize(driver.worker, sc, sc.iterations[1])
        outs = driver.run(batch.inputs)
        release(driver.worker, batch)
        return outs, driver.runners[0].next_token_logits_buffer

    outs, shared = SimulatedWorld(sc.layout).run(fn)[0]
    assert len(outs) == sc.spec.num_steps > 1
    on_shared = [o.logits.untyped_storage().data_ptr() == shared.untyped_storage().data_ptr() for o in outs]
    assert on_shared == [False] * (len(outs) - 1) + [True], "every step but the last is copied off the shared logits buffer"
    assert not torch.equal(outs[0].logits, outs[-1].logits)
