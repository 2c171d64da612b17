"""The EAGLE3 draft (runners.llama_eagle3): the target's captured layers, the widths of the buffers they go through, the
draft-to-target table, the config that asks for it, and its shipped case under every property that applies."""
import pytest
import torch

from harness import mutants
from harness.cases.case import CaseError, default_cases, load_case, parse_case
from harness.golden.acceptance import GOLDEN_CASES
from harness.pipeline.check import check_case
from harness.props.draft_decode import check_decode_case
from harness.props.draft_probes import EAGLE3_CASE, eager_tree
from harness.props.p2 import check_padded_lanes
from harness.props.p8 import CHURN_EAGLE3_SPEC, CHURN_SCRIPT, run_churn_script
from harness.props.tolerances import cross_layout
from harness.ranks.simulated import SimulatedWorld
from runners.base_cuda_graph_runner import RunnerKind
from runners.batch import ForwardBatch, ForwardMode
from runners.config import DraftKind, ModelConfig, SpecConfig, draft_input_hidden_size
from runners.decode_cuda_graph_runner import DecodeCudaGraphRunner
from runners.draft_extend import DraftWorker
from runners.draft_extend_cuda_graph_runner import DraftExtendInputBuffers
from runners.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
from runners.graph.backend import GraphBackend
from runners.llama_eagle3 import Eagle3DraftModel, d2t_table, draft_to_target, hot_token_ids
from runners.memory import ReqToTokenPool
from runners.model import TargetModel
from runners.parallel.dp_attention import RankContext
from runners.parallel.layout import ParallelLayout as PL
from runners.target import Lane, TargetRunner

MODEL = ModelConfig(num_target_layers=4, num_kv_heads=8)
SPEC = SpecConfig(num_steps=3, topk=2, num_draft_tokens=4, capture_bs=(1, 2, 4), max_running_requests=4, draft="eagle3",
                  eagle_aux_hidden_state_layer_ids=(0, 1, 2), draft_vocab_size=256)
TP1 = RankContext(PL(), 0, comm=None)
EAGLE3_CASES = ("tp1_eagle3", EAGLE3_CASE)  # TP1 over the full vocabulary reading the embeddings; TP2 DP2 with the d2t table


# ---------------------------------------------------------------- config


def test_draft_kind_keeps_the_case_file_strings_and_refuses_others():
    assert SpecConfig(draft="single_layer").draft is DraftKind.SINGLE_LAYER
    assert SpecConfig().draft is DraftKind.MULTI_LAYER and SpecConfig().draft == "multi_layer"
    assert repr(DraftKind.EAGLE3) == "DraftKind.EAGLE3"  # a failing example's @example line rebuilds it
    with pytest.raises(ValueError, match="spec.draft: one of multi_layer, single_layer, eagle3 .*, got 'eagle2'"):
        SpecConfig(draft="eagle2")


@pytest.mark.parametrize("kw,field", [
    (dict(draft="eagle3"), "spec.eagle_aux_hidden_state_layer_ids"),  # EAGLE3 reads some layers
    (dict(draft="eagle3", eagle_aux_hidden_state_layer_ids=(0, 0)), "spec.eagle_aux_hidden_state_layer_ids"),
    (dict(draft="single_layer", eagle_aux_hidden_state_layer_ids=(0,)), "spec.eagle_aux_hidden_state_layer_ids"),
    (dict(draft_vocab_size=128), "spec.draft_vocab_size"),  # a reduced vocab is EAGLE3's
    (dict(draft_tp_size=0), "spec.draft_tp_size"),
])
def test_spec_config_names_the_field_it_refuses(kw, field):
    with pytest.raises(ValueError, match=field):
        SpecConfig(**kw)


def test_the_draft_reads_num_aux_times_the_hidden_size():
    assert draft_input_hidden_size(MODEL, SPEC) == 3 * 64
    assert draft_input_hidden_size(MODEL, SpecConfig()) == 64


# ---------------------------------------------------------------- the target's capture


class CausalNoKV:
    """Attention over the batch's own tokens, causal, no cache: enough to tell the layers' outputs apart."""

    def forward(self, layer_id, q, k, v, fb, meta):
        n, rep = q.shape[0], q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("nhd,mhd->hnm", q, k) / q.shape[-1] ** 0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("hnm,mhd->nhd", s.softmax(-1), v)


def _batch(ids: torch.Tensor) -> ForwardBatch:
    n = ids.shape[0]
    return ForwardBatch(ForwardMode.EXTEND, 1, ids, torch.arange(n), torch.tensor([n]), torch.tensor([1]), torch.zeros(n, dtype=torch.int64),
                        torch.tensor([n]), torch.tensor([0]), None)


def test_the_target_hands_on_each_captured_layers_output_in_layer_order():
    """Layer i's output for id i, -1 the embeddings (the residual stream at layer i + 1's input), concatenated in layer
    order; the expected values come from running the layers one by one here."""
    model, ids = TargetModel(MODEL, TP1), torch.tensor([5, 17, 3, 99])
    fb, attn = _batch(ids), CausalNoKV()
    last, _ = model.forward(fb, attn, None)
    model.set_eagle3_layers_to_capture([2, -1, 0])
    aux, _ = model.forward(fb, attn, None)
    outputs = {-1: model.head.embed[ids]}
    for i, layer in enumerate(model.layers):
        outputs[i] = layer.forward(outputs[i - 1], fb, attn, None)
    assert aux.shape == (4, 3 * 64)
    torch.testing.assert_close(aux, torch.cat([outputs[-1], outputs[0], outputs[2]], dim=-1), rtol=0, atol=0)  # bitwise: the same ops
    torch.testing.assert_close(last, outputs[3], rtol=0, atol=0)  # without a capture: the last layer's output


@pytest.mark.parametrize("layout", [PL(4, moe_dense_tp_size=1), PL(2, 2, True)], ids=lambda x: x.describe())
def test_every_rank_captures_the_full_residual_as_tp1_does(layout):
    """TP-correct capture: on the attn-TP-gather branch (the MLP on token slices) and under DP attention (the MLP-TP
    gather), every rank hands on its requests' full captured states, equal to TP1's within the cross-layout tolerance."""
    prompt = [5, 17, 3, 99, 250, 7]

    def captured(comm, lay):
        ctx = RankContext(lay, comm.rank, comm)
        pool = ReqToTokenPool(4, MODEL.max_context_len, torch.device("cpu"))
        pool.req_to_token[1, : len(prompt)] = torch.arange(1, len(prompt) + 1)
        target = TargetRunner(ctx, MODEL, pool, 64, torch.device("cpu"))
        target.model.set_eagle3_layers_to_capture(SPEC.eagle_aux_hidden_state_layer_ids)
        return target.forward([Lane(1, 0, prompt)]).hidden  # every DP group runs the same request

    (ref,) = SimulatedWorld(PL()).run(lambda comm: captured(comm, PL()))
    tol = cross_layout(MODEL.dtype, "torch")
    for rank, got in enumerate(SimulatedWorld(layout).run(lambda comm: captured(comm, layout))):
        assert got.shape == (len(prompt), 3 * 64), rank
        torch.testing.assert_close(got, ref, rtol=tol.rtol, atol=tol.atol)  # the reordered TP sums: harness/props/tolerances.py


# ---------------------------------------------------------------- the draft-to-target table


def test_d2t_stores_differences_and_hot_ids_add_the_draft_id_back():
    d2t = torch.tensor([3, 3, 5, 0])  # hand-worked: draft ids 0..3 are target ids 3, 4, 7, 3
    assert hot_token_ids(d2t).tolist() == [3, 4, 7, 3]
    assert draft_to_target(hot_token_ids(d2t), torch.tensor([[2, 0], [1, 1]])).tolist() == [[7, 3], [4, 4]]
    assert draft_to_target(None, torch.tensor([9])).tolist() == [9]  # no reduced vocab: draft ids are target ids


def test_the_seeded_table_is_distinct_ascending_target_ids():
    hot = hot_token_ids(d2t_table(MODEL, 256))
    assert hot.shape == (256,) and bool((hot[1:] > hot[:-1]).all()) and 0 <= int(hot[0]) and int(hot[-1]) < MODEL.vocab_size
    assert bool((d2t_table(MODEL, 256) >= 0).all())  # ascending hot ids: every difference >= 0
    assert torch.equal(hot, Eagle3DraftModel(MODEL, SPEC, TP1).hot_token_id)


def test_fc_projects_the_targets_states_and_never_the_drafts_own():
    """The draft-extend's hidden input is 3H wide (fc applies), the draft decode's H wide (fc skipped: its fc may be
    anything)."""
    model = Eagle3DraftModel(MODEL, SPEC, TP1)
    layer = model.layers[0]
    assert layer.fc.shape == (64, 192) and layer.layer.w_qkv.shape[1] == 128  # qkv over [norm(embeds); norm(hidden)]
    n, g = 3, torch.Generator().manual_seed(0)
    emb, own = torch.randn(n, 64, generator=g), torch.randn(n, 64, generator=g)
    fb = _batch(torch.zeros(n, dtype=torch.int64))

    class SelfOnly:
        def forward(self, layer_id, q, k, v, fb, meta):
            return v.repeat_interleave(q.shape[1] // v.shape[1], 1)

    before = layer.forward(emb, own, fb, SelfOnly(), None)[0]
    layer.fc.mul_(2)
    assert torch.equal(before, layer.forward(emb, own, fb, SelfOnly(), None)[0])
    aux = torch.randn(n, 192, generator=g)
    assert not torch.equal(layer.forward(emb, aux, fb, SelfOnly(), None)[0], before)


# ---------------------------------------------------------------- buffer widths


def test_graph_runners_size_their_hidden_buffers_for_what_they_receive():
    worker = DraftWorker(TP1, MODEL, SPEC, build_model=False)
    extend = DraftExtendInputBuffers.allocate(worker)
    assert extend.hidden_states.shape[1] == 192  # the target's captured layers
    assert worker.num_layers == 1 and worker.vocab_size == 256
    decode = EAGLEDraftCudaGraphRunner(worker, GraphBackend("sim"))
    assert decode.hidden_states.shape[1] == 64  # the draft's own output, step to step

    def verify(comm):
        from runners.memory import ReqToTokenPool
        from runners.target import TargetRunner
        ctx = RankContext(PL(), 0, comm)
        target = TargetRunner(ctx, MODEL, ReqToTokenPool(8, MODEL.max_context_len, torch.device("cpu")), 64, torch.device("cpu"))
        return DecodeCudaGraphRunner(ctx, MODEL, SPEC, target, GraphBackend("sim")).hidden_buffer.shape[1]

    assert SimulatedWorld(PL()).run(verify) == [192]  # what the target verify hands the draft-extend


# ---------------------------------------------------------------- the shipped case under every property


@pytest.mark.parametrize("name", EAGLE3_CASES)
def test_the_case_is_shipped_with_every_golden_and_in_every_parametrized_check(name):
    assert name in [c.name for c in default_cases()]  # `harness check`, tests/test_golden.py (the array golden)
    assert name in GOLDEN_CASES  # tests/test_spec_decode.py's P3 / P5 / P6 over the loop
    out = check_decode_case(load_case(name))  # the loop eager and graph: P1 draft-decode replays, P3 trees, P6 both goldens
    assert set(out) == {"P1", "P3", "P6"} and all(v.ok for v in out.values()), {k: v.report(3) for k, v in out.items()}


@pytest.mark.parametrize("name", EAGLE3_CASES)
def test_harness_check_runs_the_eagle3_draft_extend_runner(name):
    """`harness check`'s default properties on the case, with the EAGLE3 runner (one step, the single-layer runner)
    replaying every iteration on every rank."""
    case = load_case(name)
    rep = check_case(case)
    assert rep.ok, rep.first_failure()
    assert set(rep.verdicts) == {"P1", "P3", "P4"}
    for run in rep.runs:
        kinds = {rec.runner for recs in run.records for rec in recs}
        assert kinds == {RunnerKind.SINGLE_LAYER} and run.stats.replays == len(run.records)
        assert all(len(steps) == 1 for steps in run.graph)
        assert run.graph[0][0].out.logits.shape[1] == (case.scenario.spec.draft_vocab_size or 512)  # the draft's vocabulary


def test_p2_holds_on_the_eagle3_case():
    v = check_padded_lanes(load_case(EAGLE3_CASE))
    assert "run" not in v and v["P2"].ok, v["P2"].report()


def test_p8_churn_over_the_eagle3_draft():
    out = run_churn_script(PL(), CHURN_SCRIPT, CHURN_EAGLE3_SPEC)
    assert "run" not in out, out["run"].report()
    assert out["P8"].ok and out["P8"].checked > 100, out["P8"].report()


def test_only_the_goldens_see_a_wrong_captured_layer():
    """P3 and P4 compare the code with itself (eager with graph, a layout with TP1): a layer captured off by one is the
    same in each, so the case's default check passes; the draft-tree golden (P6) does not."""
    case = load_case(EAGLE3_CASE)
    with mutants.get("eagle3-capture-unshifted").planted():
        assert check_case(case).ok
        assert not eager_tree(EAGLE3_CASE)["P6"].ok


# ---------------------------------------------------------------- the case loader


def _case(**spec) -> dict:
    return {"name": "x", "description": "d", "model": {"num_target_layers": 4, "num_kv_heads": 8}, "layout": {"tp_size": 2},
            "spec": {"num_steps": 3, "capture_bs": [1, 2], "max_running_requests": 2, "draft": "eagle3", **spec},
            "schedule": {"batches": [[2]]}}


@pytest.mark.parametrize("spec,field", [
    ({"eagle_aux_hidden_state_layer_ids": [0, 3]}, "spec.eagle_aux_hidden_state_layer_ids"),  # layer 3's output has no next layer
    ({"eagle_aux_hidden_state_layer_ids": [0, 1.5]}, "spec.eagle_aux_hidden_state_layer_ids"),
    ({"eagle_aux_hidden_state_layer_ids": [0], "draft_vocab_size": 255}, "spec.draft_vocab_size"),  # over 2 lm_head ranks
    ({"eagle_aux_hidden_state_layer_ids": [0], "draft_vocab_size": 1024}, "spec.draft_vocab_size"),  # past the target's vocab
    ({"eagle_aux_hidden_state_layer_ids": [0], "draft_tp_size": 3}, "spec.draft_tp_size"),
])
def test_the_loader_names_the_draft_field(spec, field):
    with pytest.raises(CaseError, match=field) as err:
        parse_case(_case(**spec))
    assert "\n" not in str(err.value)


def test_the_loader_reads_an_eagle3_case():
    sc = parse_case(_case(eagle_aux_hidden_state_layer_ids=[-1, 2], draft_vocab_size=128)).scenario
    assert sc.spec.draft is DraftKind.EAGLE3 and sc.spec.eagle_aux_hidden_state_layer_ids == (-1, 2) and sc.spec.draft_vocab_size == 128
