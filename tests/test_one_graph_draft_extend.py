"""The one-graph draft-extend composite (runners.multi_layer_eagle_draft_extend_cuda_graph_runner) against the per-step one, and its config."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from harness.cases.case import CaseError, load_case, parse_case
from harness.golden.base import GOLDEN_DIR
from harness.ranks.simulated import SimulatedWorld
from harness.run.rig import prepare
from harness.run.scenario import Scenario
from runners.config import DraftExtendGraph, SpecConfig
from runners.draft_extend_graph_driver import DraftExtendGraphDriver
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import (
    OneGraphMultiLayerEagleMultiStepDraftExtendCudaGraphRunner,
)
from tests.helpers.case_driver import captured_driver


def _with(sc: Scenario, graph: DraftExtendGraph) -> Scenario:
    return replace(sc, spec=replace(sc.spec, draft_extend_graph=graph))


def _run(sc: Scenario, after_capture=None) -> tuple[list[list[dict]], object]:
    """Rank 0's graph outputs (copied) of every iteration and step, and its graph stats."""
    def fn(comm):
        driver = captured_driver(comm, sc)
        if after_capture is not None:
            after_capture(driver)
        outs = [[o.cloned().tensors() for o in driver.run(prepare(driver.worker, sc, it).inputs)] for it in range(len(sc.iterations))]
        return outs, driver.stats

    return SimulatedWorld(sc.layout).run(fn)[0]


SC = load_case("tp2_shrink").scenario  # a shrink: batches of 8, 6, 2 and 1 in buckets 8, 8, 2 and 2 (padded lanes)


def test_one_graph_replays_once_per_iteration_and_matches_the_per_step_graphs_bitwise():
    per_step, ps_stats = _run(SC)
    one, og_stats = _run(_with(SC, DraftExtendGraph.ONE_GRAPH))
    steps, iterations = SC.spec.num_steps, len(SC.iterations)
    assert (ps_stats.captures, ps_stats.replays) == (steps * 3, steps * iterations)  # buckets 2, 4, 8 (base 2)
    assert (og_stats.captures, og_stats.replays, og_stats.eager_fallbacks) == (3, iterations, 0)
    for it, (a, b) in enumerate(zip(per_step, one, strict=True)):
        for step, (x, y) in enumerate(zip(a, b, strict=True)):
            for name in x:
                assert torch.equal(x[name], y[name]), (it, step, name)


def test_nothing_the_capture_leaves_in_the_chain_buffers_reaches_an_output():
    """Why the composite has no snapshot and restore around capture (SGLang's has): the warm-ups' chain writes token
    ids and hidden states; prepare rewrites every token id and the live hidden states, so garbage left there after
    capture changes no output."""
    def poison_chain_buffers(driver) -> None:
        assert isinstance(driver.multi_step, OneGraphMultiLayerEagleMultiStepDraftExtendCudaGraphRunner)
        driver.multi_step.buffers.input_ids.fill_(driver.worker.cfg.vocab_size - 1)
        driver.multi_step.buffers.hidden_states.fill_(float("nan"))

    sc = _with(SC, DraftExtendGraph.ONE_GRAPH)
    clean, _ = _run(sc)
    poisoned, _ = _run(sc, poison_chain_buffers)
    for a, b in zip(clean, poisoned, strict=True):
        for x, y in zip(a, b, strict=True):
            assert all(torch.equal(x[name], y[name]) for name in x)


def test_the_one_graph_golden_is_the_per_step_golden():
    """Recorded apart, each through its own composite (cases/tp2_shrink*.toml differ in draft_extend_graph only)."""
    with np.load(GOLDEN_DIR / "tp2_shrink.npz") as a, np.load(GOLDEN_DIR / "tp2_shrink_one_graph.npz") as b:
        assert sorted(a.files) == sorted(b.files) and len(a.files) > 0
        for key in a.files:
            assert np.array_equal(a[key], b[key], equal_nan=True), key
    assert load_case("tp2_shrink_one_graph").scenario.spec.draft_extend_graph is DraftExtendGraph.ONE_GRAPH


def test_spec_config_takes_the_value_and_refuses_the_rest():
    assert SpecConfig(draft_extend_graph="one_graph").draft_extend_graph is DraftExtendGraph.ONE_GRAPH
    assert SpecConfig().draft_extend_graph is DraftExtendGraph.PER_STEP
    with pytest.raises(ValueError, match="per_step, one_graph"):
        SpecConfig(draft_extend_graph="single_cg")
    with pytest.raises(ValueError, match="multi-layer draft"):
        SpecConfig(draft="single_layer", draft_extend_graph="one_graph")


@pytest.mark.parametrize("spec,rule", [({"draft_extend_graph": "one"}, "one of per_step, one_graph"),
                                       ({"draft_extend_graph": "one_graph", "draft": "single_layer"}, "draft = single_layer")])
def test_a_case_file_names_the_field(spec, rule):
    data = {"name": "x", "description": "d", "layout": {"tp_size": 1}, "spec": {"num_steps": 2, **spec}, "schedule": {"batches": [[1]]}}
    with pytest.raises(CaseError) as e:
        parse_case(data)
    assert e.value.field == "spec.draft_extend_graph" and rule in str(e.value)


def test_the_one_graph_is_refused_with_a_backend_that_plans_on_the_host():
    """flashinfer plans each step's metadata on the host before its replay, which one replay for every step cannot do
    (SGLang's worker builds the per-step composite for such a backend): the driver says so instead of building it."""
    worker = SimpleNamespace(spec=SpecConfig(draft_extend_graph="one_graph"), attn=SimpleNamespace(name="flashinfer"))
    with pytest.raises(ValueError, match="attention backend flashinfer: the one-graph draft-extend composite needs"):
        DraftExtendGraphDriver(worker, backend=None)
