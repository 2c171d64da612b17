"""P1, P3 and P4 driven by hypothesis, and each shown to fail on a planted bug."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import mutants
from harness.cases.case import load_case, seeded_requests
from harness.pipeline.check import check_case
from harness.props.p1 import check_run_metadata
from harness.props.p1_metadata import check_metadata
from harness.props.p3 import check_eager_vs_graph
from harness.props.p4 import check_cross_layout
from harness.run.case_run import run_spmd
from harness.run.layouts import all_layouts, deployed_layouts
from harness.run.scenario import Scenario
from harness.run.strategies import failure_case, layouts, schedules, specs
from runners.config import DraftExtendGraph, ModelConfig, SpecConfig
from runners.parallel.layout import Branch
from runners.parallel.layout import ParallelLayout as PL
from tests.helpers.shared import computed_once


@st.composite
def metadata_examples(draw, min_world: int = 1, max_world: int = 8):
    layout = draw(layouts(max_world, min_world))
    spec = draw(specs())
    return layout, spec, draw(schedules(layout, max_bs=spec.max_running_requests))


@settings(max_examples=settings().max_examples * 5)  # pure metadata: cheap, so 5x the profile's budget
@given(metadata_examples())
def test_p1_metadata_invariants_hold(example):
    layout, spec, schedule = example
    with failure_case(layout, spec, schedule, prop="P1"):  # a shrunk failure becomes a ready case file
        v = check_metadata(layout, spec, schedule)
        assert v, v.report()


@given(metadata_examples(min_world=16, max_world=64))  # the profile's budget: a rank per DP group (up to 64) makes each ~10x a single-node one
def test_p1_metadata_invariants_hold_multi_node(example):
    layout, spec, schedule = example
    with failure_case(layout, spec, schedule, prop="P1"):
        v = check_metadata(layout, spec, schedule)
        assert v, v.report()


ATTN_TP_GATHER_LAYOUTS = [x for x in all_layouts() if x.branch is Branch.ATTN_TP_GATHER][:6] + [
    x for x in deployed_layouts() if x.branch is Branch.ATTN_TP_GATHER and x.tp_size in (32, 64) and x.dp_size == 8]


@pytest.mark.parametrize("layout", ATTN_TP_GATHER_LAYOUTS, ids=lambda x: x.describe())
def test_p1_names_the_seed_bug(layout):
    with mutants.get("sglang-26416").planted():
        v = check_metadata(layout, SpecConfig(capture_bs=(1, 2, 4, 8), max_running_requests=8), [(3,) * layout.attn_dp_size])
    assert not v
    f = v.failures[0]
    msg = f.message()
    assert "global_num_tokens_for_logprob" in msg and "attn_tp_gather" in msg
    bs = f.where["bs"]
    assert f.expected == [bs * 4] and f.got == [bs], msg  # expected bs*T, got bs


def _scenario(layout: PL, spec: SpecConfig, schedule, seed: int) -> Scenario:
    model = ModelConfig(seed=seed)
    return Scenario(model, spec, layout, seeded_requests(seed, tuple(tuple(s) for s in schedule), spec.num_tokens_per_bs, 12), seed=seed)


@st.composite
def run_examples(draw, graph: DraftExtendGraph, max_world=4):
    layout = draw(layouts(max_world))
    spec = SpecConfig(num_steps=draw(st.integers(1, 3)), topk=draw(st.integers(1, 3)), capture_bs=(1, 2, 4), max_running_requests=4,
                      draft_extend_graph=graph)
    return _scenario(layout, spec, draw(schedules(layout, max_bs=4, max_iterations=2)), draw(st.integers(0, 3)))


@pytest.mark.parametrize("graph", list(DraftExtendGraph), ids=str)  # SGLang's two multi-layer draft-extend composites
@settings(max_examples=max(5, settings().max_examples // 2))  # each example runs every rank of a layout
@given(data=st.data())
def test_p1_p3_p4_eager_graph_and_cross_layout(graph, data):
    sc = data.draw(run_examples(graph))
    with failure_case(scenario=sc, prop="P1/P3/P4"):
        runs = run_spmd(sc)
        oracle = run_spmd(sc.as_tp1(), runner="eager")
        for v in (check_run_metadata(sc, runs), check_eager_vs_graph(sc, runs), check_cross_layout(sc, runs, oracle, "eager"),
                  check_cross_layout(sc, runs, oracle, "graph")):
            assert v, v.report()


def test_seed_bug_fails_p3_and_p4_independently_of_p1():
    case = load_case("tp4_attn_tp_gather")
    with mutants.get("sglang-26416").planted():
        rep = check_case(case, props=("P3", "P4"))  # P1 not even run
    assert not rep.verdicts["P3"] and not rep.verdicts["P4"]
    assert "logits" in rep.verdicts["P3"].first()


def test_broken_layout_gather_fails_p4_naming_layout_rank_row():
    """A deliberately broken DP gather: P4 (eager, vs TP1) names the layout, the rank and the first differing row."""
    case = load_case("tp4_dp2_mlp_tp_gather")
    with mutants.get("dp-scatter-wrong-chunk").planted():
        rep = check_case(case, props=("P4",))
    v = rep.verdicts["P4"]
    assert not v
    f = next(f for f in v.failures if f.where["runner"] == "eager")
    msg = f.message()
    assert "tp4-dp2 [mlp_tp_gather]" in msg and "rank=" in msg and "first differing row" in msg, msg


@pytest.mark.parametrize(
    "mutant_id,case_name,prop",
    [
        ("sglang-26416", "tp2_shrink", "P1"),
        ("capture-num-tokens-gpu-requests", "tp4_dp2_mlp_tp_gather", "P1"),
        ("stale-padded-seq-lens", "tp2_shrink", "P1"),
        ("replay-positions-off-by-one", "tp1_neither", "P3"),
        ("bucket-floor", "tp1_neither", "P1"),
        ("attn-allreduce-world-group", "tp4_dp2_mlp_tp_gather", "P4"),  # DP-padded ranks reduce equal shapes: wrong sums, not a desync
        ("dp-scatter-wrong-chunk", "tp2_dp2_mlp_dp_lm_head", "P4"),
    ],
)
def test_each_mutant_is_killed(mutant_id, case_name, prop, tmp_path_factory):
    case = load_case(case_name)
    # the unmutated case passes: the kill is the mutant's doing (checked once per case for the mutants that share it)
    assert computed_once(tmp_path_factory, f"unmutated-check-{case_name}", lambda: check_case(case).ok)
    with mutants.get(mutant_id).planted():
        rep = check_case(case)
    assert not rep.verdicts[prop], f"{mutant_id} survived {prop} on {case_name}"


def test_mutant_patches_are_reverted():
    from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import MultiLayerEagleDraftExtendCudaGraphRunner as R

    before = R.get_forward_batch
    with mutants.get("sglang-26416").planted():
        assert R.get_forward_batch is not before
    assert R.get_forward_batch is before
