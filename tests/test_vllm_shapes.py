"""vLLM's padding convention (-1 slots that every KV write skips) and vLLM's shapes of the draft-extend (the ragged runner
with its last-token gather index, PIECEWISE graphs), beside SGLang's: the options, the mechanisms by hand, the
ragged pass against the fixed-shape one, each shipped case through `harness check` and P2, and P8 churn per shape."""
from __future__ import annotations

import json
import tomllib
from dataclasses import replace

import pytest
import torch

from harness import mutants
from harness.cases.case import CASES_DIR, CaseError, default_cases, load_case, parse_case
from harness.cli import main
from harness.pipeline.check import check_case
from harness.props.p2 import check_padded_lanes
from harness.props.p8 import CHURN_SCRIPT, run_churn_script
from harness.run.loop import acceptance_stats, case_session
from harness.run.scenario import materialize
from runners.base_cuda_graph_runner import RunnerKind
from runners.config import CudaGraphMode, DraftExtendShape, PaddingConvention, SpecConfig
from runners.draft_extend import DraftWorker, run_eager
from runners.graph.piecewise import PiecewiseGraph, graph_break
from runners.graph.pool import RecordedPool
from runners.memory import PAD_SLOT_ID, ReqToTokenPool, TokenToKVPool, lane_padding, write_slots
from runners.parallel.dp_attention import RankContext
from runners.parallel.layout import ParallelLayout as PL
from runners.ragged_draft_extend import RaggedPlan, run_eager_ragged

PAD_MINUS_ONE_CASE, RAGGED_CASE, PIECEWISE_CASE = "tp2_dp2_pad_minus_one", "tp2_ragged_draft_extend", "tp2_piecewise"
CASES = {PAD_MINUS_ONE_CASE: None, RAGGED_CASE: RunnerKind.RAGGED, PIECEWISE_CASE: RunnerKind.PIECEWISE}
CHURN_BASE = dict(num_steps=3, topk=1, capture_bs=(1, 2, 4, 8), max_running_requests=8)


# ---------------------------------------------------------------- the options


def test_options_are_named_by_value_and_default_to_sglang_full_fixed():
    spec = SpecConfig(padding_convention="vllm_pad_minus_one", draft_extend_shape="ragged")
    assert spec.padding_convention is PaddingConvention.VLLM_PAD_MINUS_ONE and spec.draft_extend_shape is DraftExtendShape.RAGGED
    d = SpecConfig()
    assert (d.padding_convention, d.draft_extend_shape, d.cuda_graph_mode) == (
        PaddingConvention.SGLANG_DUMMY_SLOT, DraftExtendShape.FIXED, CudaGraphMode.FULL)


@pytest.mark.parametrize("spec,message", [
    ({"cuda_graph_mode": "pw"}, "cuda_graph_mode: one of full, piecewise, got 'pw'"),
    ({"draft_extend_shape": "ragged", "draft": "single_layer"}, "draft_extend_shape: the multi-layer draft"),
    ({"cuda_graph_mode": "piecewise", "draft_extend_graph": "one_graph"}, "draft_extend_graph 'one_graph'"),
    ({"draft_extend_shape": "ragged", "cuda_graph_mode": "piecewise"}, "draft_extend_shape: 'fixed' with cuda_graph_mode 'piecewise'"),
])
def test_spec_refuses_what_no_runner_builds(spec, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig(**spec)


@pytest.mark.parametrize("edit,field", [({"spec": {"padding_convention": "minus_one"}}, "spec.padding_convention"),
                                        ({"spec": {"draft_extend_shape": "ragged", "draft": "single_layer"}}, "spec.draft_extend_shape"),
                                        ({"layout": {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}}, "spec.draft_extend_shape")])
def test_case_loader_names_the_field(edit, field):
    data = tomllib.loads((CASES_DIR / f"{RAGGED_CASE}.toml").read_text())
    for table, values in edit.items():
        data[table] = {**data[table], **values}
    with pytest.raises(CaseError, match=f"{field}: expected"):
        parse_case(data, CASES_DIR / f"{RAGGED_CASE}.toml")


# ---------------------------------------------------------------- the -1 convention by hand


def test_kv_write_skips_pad_slot_and_writes_the_rest():
    kv = TokenToKVPool(1, 6, 1, 2, torch.float32, torch.device("cpu"))
    k = torch.tensor([[[1.0, 1.0]], [[2.0, 2.0]], [[3.0, 3.0]]])
    kv.write(0, torch.tensor([2, PAD_SLOT_ID, 5]), k, -k)
    assert kv.k[0][:, 0, 0].tolist() == [0, 0, 1, 0, 0, 3]  # slot 2 <- token 0, slot 5 <- token 2, the last slot untouched by -1
    assert kv.v[0][:, 0, 0].tolist() == [0, 0, -1, 0, 0, -3]


def test_conventions_reserve_row_zero_or_none_and_pad_requests_write_minus_one():
    sglang = ReqToTokenPool(3, 4, torch.device("cpu"))
    vllm = ReqToTokenPool(3, 4, torch.device("cpu"), PaddingConvention.VLLM_PAD_MINUS_ONE)
    assert [sglang.alloc(), sglang.alloc()] == [1, 2] and [vllm.alloc(), vllm.alloc(), vllm.alloc()] == [0, 1, 2]
    assert lane_padding(PaddingConvention.SGLANG_DUMMY_SLOT) == lane_padding("sglang_dummy_slot")
    assert (lane_padding("vllm_pad_minus_one").row, lane_padding("vllm_pad_minus_one").slot) == (-1, -1)
    table = torch.tensor([[7, 8], [9, 10]])
    assert write_slots(table, torch.tensor([1, -1, 0]), torch.tensor([1, 0, 0]), PAD_SLOT_ID).tolist() == [10, -1, 7]
    assert write_slots(table, torch.tensor([1, 0]), torch.tensor([0, 1])).tolist() == [9, 8]


# ---------------------------------------------------------------- the ragged layout by hand, and against the fixed shape


def test_ragged_plan_packs_accepted_tokens_and_pads_lanes_onto_their_own_rows():
    plan = RaggedPlan((1, 3, 2), T=4)
    assert plan.num_tokens == 6 and plan.starts == [0, 1, 4]
    assert plan.pack == [0, 4, 5, 6, 8, 9]  # request-major rows: request 1's 3 tokens are rows 4..6
    assert plan.last_token_indices == [0, 3, 5]
    assert plan.padded(5) == ([6, 7], [1, 1], [6, 7])  # lanes 3 and 4: one padding token each, inside 5 * 4 rows


def test_ragged_pass_equals_the_fixed_shape_pass_on_the_accepted_rows():
    """The ragged layout leaves out only rejected tokens, which no accepted token attends to (causal by position): its
    outputs on every accepted row equal DRAFT_EXTEND_V2's, step after step, and its rejected rows are zero."""
    sc = load_case(RAGGED_CASE).scenario
    spec = SpecConfig(**{**CHURN_BASE, "capture_bs": sc.spec.capture_bs, "max_running_requests": 4})
    outs = {}
    for shape in DraftExtendShape:
        worker = DraftWorker(RankContext(PL(), 0, None), sc.model, SpecConfig(**{**vars(spec), "draft_extend_shape": shape}))
        batch = materialize(worker, sc, sc.iterations[1])  # accept lengths 4, 3, 2
        outs[shape] = (run_eager_ragged if shape is DraftExtendShape.RAGGED else run_eager)(worker, batch.inputs)[0]
    plan = RaggedPlan((4, 3, 2), T=4)
    rows, rejected = plan.pack, sorted(set(range(12)) - set(plan.pack))
    for fixed, ragged in zip(outs[DraftExtendShape.FIXED], outs[DraftExtendShape.RAGGED], strict=True):
        torch.testing.assert_close(ragged.logits[rows], fixed.logits[rows], rtol=1e-5, atol=1e-5)  # fp32, sums of other lengths
        torch.testing.assert_close(ragged.hidden[rows], fixed.hidden[rows], rtol=1e-5, atol=1e-5)
        assert torch.equal(ragged.topk_index, fixed.topk_index) and torch.equal(ragged.next_input_ids[rows], fixed.next_input_ids[rows])
        assert not ragged.logits[rejected].any() and not ragged.hidden[rejected].any()


@pytest.mark.parametrize("name,option", [(RAGGED_CASE, "draft_extend_shape"), (PIECEWISE_CASE, "cuda_graph_mode")])
def test_a_shape_changes_no_proposal_of_the_loop(name, option):
    """The case's workload through the loop (graph runners) proposes what the same spec with SGLang's FULL, fixed-shape
    draft-extend proposes: every request's accept lengths are the same (the shapes change where padding goes, not what
    is computed for a live token)."""
    case = load_case(name)
    fixed = replace(case.scenario.spec, **{option: SpecConfig.__dataclass_fields__[option].default})
    stats = [acceptance_stats(case_session(c, "graph", rounds_per_phase=2))["requests"]
             for c in (case, replace(case, scenario=replace(case.scenario, spec=fixed)))]
    assert stats[0] == stats[1]


# ---------------------------------------------------------------- PIECEWISE graphs by hand


def test_piecewise_graph_replays_its_pieces_around_an_eager_break():
    x, live, mid, out = torch.ones(3), torch.zeros(3), torch.zeros(3), torch.zeros(3)
    calls = []

    def attention():  # the eager part: reads a host-side value the pieces never bake
        calls.append(len(calls))
        mid.copy_(2 * x + live)

    def body():
        h = x * 3  # piece 0
        graph_break(attention)
        out.copy_(mid + h)  # piece 1 reads what the break wrote
        return out

    g = PiecewiseGraph(body, RecordedPool())
    g.capture()
    assert g.num_pieces == 2 and calls == [0] and out.tolist() == [5.0] * 3
    x.fill_(2.0)
    live.fill_(10.0)
    g.replay()
    assert calls == [0, 1] and out.tolist() == [20.0] * 3  # 2 * 2 + 10 from the break, 2 * 3 from piece 0
    graph_break(attention)  # outside a capture: just runs
    assert calls == [0, 1, 2]


# ---------------------------------------------------------------- the shipped cases: harness check, P2, P8


def test_harness_check_runs_every_new_case_and_its_default_run_includes_them(capsys):
    assert set(CASES) <= {c.name for c in default_cases()}  # `harness check` with no case runs every one of cases/
    assert main(["check", "--json", *CASES]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {c["case"]: c["status"] for c in report["cases"]} == dict.fromkeys(CASES, "pass")
    for c in report["cases"]:
        assert {p: v["checked"] > 0 for p, v in c["properties"].items()} == {"P1": True, "P3": True, "P4": True}, c["case"]


@pytest.mark.parametrize("name", CASES)
def test_the_case_replays_its_runner_with_padded_lanes(name):
    """What `harness check` ran (check_case): the case's runner kind replayed, buckets with padded lanes among them."""
    rep = check_case(load_case(name), props=("P1",))
    recs = [rec for run in rep.runs for recs in run.records for rec in recs]
    assert {rec.runner for rec in recs} == {CASES[name] or RunnerKind.MULTI_LAYER}
    assert any(rec.bs > rec.raw_bs for rec in recs), "a replay with padded lanes"


@pytest.mark.parametrize("name", CASES)
def test_p2_holds_on_the_case(name):
    v = check_padded_lanes(load_case(name))
    assert set(v) == {"P2"} and v["P2"] and v["P2"].checked > 200, v["P2"].report()


def test_p2_holds_for_the_single_layer_runners_under_minus_one():
    """The single-layer draft-extend and the draft-decode runners pad with -1 too (the draft decode's slots per step)."""
    case = load_case("tp2_single_layer_shrink")
    spec = replace(case.scenario.spec, padding_convention=PaddingConvention.VLLM_PAD_MINUS_ONE)
    v = check_padded_lanes(replace(case, scenario=replace(case.scenario, spec=spec)))
    assert set(v) == {"P2"} and v["P2"] and v["P2"].checked > 200, v["P2"].report()


def test_p2_alone_sees_a_write_that_does_not_skip_minus_one():
    case = load_case(PAD_MINUS_ONE_CASE)
    with mutants.get("kv-write-pad-slot-not-skipped").planted():
        assert check_case(case).ok  # the last slot belongs to no request: no output shows the write ...
        v = check_padded_lanes(case)["P2"]
    assert not v and {f.check for f in v.failures} == {"pad-slot"}, v.report()  # ... the clean replay wrote it


@pytest.mark.parametrize("option", [{"draft_extend_shape": "ragged"}, {"cuda_graph_mode": "piecewise"}], ids=lambda o: next(iter(o.values())))
def test_p8_churn_holds_for_each_shape(option):
    """P8 where it parametrizes by runner: each new runner, eager and graph side by side under churn (the -1 convention
    runs the fixed runners; P2 and P3 hold it on its DP case)."""
    v = run_churn_script(PL(), CHURN_SCRIPT, SpecConfig(**CHURN_BASE, **option))
    assert set(v) == {"P8"} and v["P8"], v["P8"].report()
