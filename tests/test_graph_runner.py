"""The graph runners: per-branch capture metadata (by hand), buckets,
replay fill, padded lanes, and the honesty of the CPU graph simulation."""
import pytest
import torch

from harness.cases.case import load_case
from harness.run.case_run import run_spmd
from harness.run.observe import RunnerObserver, observe_all
from runners.base_cuda_graph_runner import compute_capture_bs
from runners.config import ModelConfig, SpecConfig
from runners.draft_extend import SEQ_LEN_FILL_VALUE, DraftExtendInputs, DraftWorker
from runners.eagle_draft_extend_cuda_graph_runner import EAGLEDraftExtendCudaGraphRunner
from runners.graph.backend import GraphBackend
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import MultiLayerEagleDraftExtendCudaGraphRunner
from runners.parallel.dp_attention import RankContext
from runners.parallel.layout import ParallelLayout as PL
from tests.helpers.case_driver import captured_driver

SPEC = SpecConfig(num_steps=3, capture_bs=(1, 2, 4, 8), max_running_requests=8)  # T = 4


def runner(layout, tp_rank=0, single=False, spec=SPEC):
    ctx = RankContext(layout, tp_rank, comm=None)
    w = DraftWorker(ctx, ModelConfig(), spec, num_layers=1 if single else None, build_model=False)
    return EAGLEDraftExtendCudaGraphRunner(w, GraphBackend("sim")) if single else MultiLayerEagleDraftExtendCudaGraphRunner(w, 0, GraphBackend("sim"))


def inputs(raw_bs, T=4, dp_sizes=None, seq=10):
    n = raw_bs * T
    return DraftExtendInputs(
        torch.arange(n), torch.arange(n), torch.full((raw_bs,), seq), torch.arange(1, raw_bs + 1),
        torch.zeros(n, 64), torch.full((raw_bs,), 2), dp_sizes or [raw_bs],
    )


# The per-branch metadata for bs = 4, T = 4 (N = 16), dp = 2: hand-computed
@pytest.mark.parametrize(
    "layout,gnt,lp,buf",
    [
        (PL(4, 2, True), [16, 16], [16, 16], 32),  # MLP-TP gather: [N]*dp, buffer N*dp
        (PL(4, 2, True, 1, True, "deepep"), [16], [16], 16),  # attn-TP gather (fixed): [N]
        (PL(4, moe_dense_tp_size=1), [16], [16], 16),
        (PL(4), None, None, None),  # neither
    ],
    ids=["mlp", "attn-dp", "attn", "neither"],
)
@pytest.mark.parametrize("single", [False, True], ids=["multi", "single"])
def test_get_forward_batch_per_branch(layout, gnt, lp, buf, single):
    r = runner(layout, single=single)
    fb = r.get_forward_batch(4)
    assert fb.forward_mode.name == "DRAFT_EXTEND_V2" and fb.batch_size == 4 and fb.num_tokens == 16
    assert fb.global_num_tokens_cpu == gnt
    assert fb.global_num_tokens_for_logprob_cpu == lp
    assert fb.global_dp_buffer_len == buf
    if gnt is None:
        assert fb.global_num_tokens_gpu is None and fb.global_num_tokens_for_logprob_gpu is None
    else:
        assert fb.global_num_tokens_gpu.tolist() == gnt and fb.global_num_tokens_for_logprob_gpu.tolist() == lp
        assert fb.global_num_tokens_gpu.dtype == torch.int32


def test_capture_bs_base_and_pool():
    assert compute_capture_bs(PL(1), (1, 2, 4, 8), 8) == [1, 2, 4, 8]
    assert compute_capture_bs(PL(4, moe_dense_tp_size=1), (1, 2, 4, 8), 8) == [4, 8]  # base attn_tp_size
    assert compute_capture_bs(PL(4), (1, 2, 4, 8, 16), 6) == [1, 2, 4, 6]  # cut at the pool, pool size added
    assert compute_capture_bs(PL(8, moe_dense_tp_size=1), (1, 2, 4), 8) == [8]


def test_capture_bs_aligned_by_tokens():
    """The target verify's rule (tokens_per_bs = T): bs * T, not bs, a multiple of the base; bs again under two-batch overlap."""
    attn8 = PL(8, moe_dense_tp_size=1)  # attn-TP gather, base 8
    assert compute_capture_bs(attn8, (1, 2, 4, 8), 8, tokens_per_bs=4) == [2, 4, 8]  # 2 * 4 = 8 tokens split over 8 ranks
    assert compute_capture_bs(attn8, (1, 2, 4, 8), 8) == [8]  # the draft runners' rule on the same list
    assert compute_capture_bs(attn8, (1, 2, 4, 8, 16), 6, tokens_per_bs=4) == [2, 4, 8]  # pool 6 rounded up to 8
    assert compute_capture_bs(attn8, (1, 2, 4), 3, tokens_per_bs=4) == [2, 4]  # 4 fits the rounded pool (8): no pool bucket
    assert compute_capture_bs(PL(4, moe_dense_tp_size=1, enable_two_batch_overlap=True), (1, 2, 4, 8, 16), 16, tokens_per_bs=4) == [8, 16]


def test_replay_picks_smallest_bucket_and_fills():
    r = runner(PL(4, 2, True))
    observer = RunnerObserver(r)
    rec = observer.prepare(inputs(3, dp_sizes=[3, 1]))
    assert (rec.raw_bs, rec.bs) == (3, 4)
    assert rec.global_num_tokens_gpu == [16, 16] and rec.global_num_tokens_for_logprob_gpu == [16, 16]  # fill bs*T
    assert rec.padded_seq_lens == [SEQ_LEN_FILL_VALUE]
    # MLP branch: the bucket covers the largest DP group, not this one
    rec = observer.prepare(inputs(1, dp_sizes=[1, 5]))
    assert rec.bs == 8


def test_padded_lanes_get_the_padding_row_and_seq_len_fill_after_a_shrink():
    """As SGLang 0.5.23: after a shrink, padded lanes' req_pool_indices are the padding row 0, not
    the larger batch's rows (the step body looks KV write slots up through them); seq_lens are the fill."""
    r = runner(PL(1))
    assert r.prepare_replay(inputs(7)) == 8
    assert r.prepare_replay(inputs(2)) == 2
    assert r.req_pool_indices[:7].tolist() == [1, 2, 0, 0, 0, 0, 0]  # the larger batch had rows 1..7
    assert r.seq_lens[2:8].tolist() == [SEQ_LEN_FILL_VALUE] * 6


def test_simulated_graph_replays_capture_time_host_values():
    """Honesty: a replay uses the host values baked at capture, never the live ones."""
    case = load_case("tp4_attn_tp_gather")
    from harness import mutants

    with mutants.get("sglang-26416").planted():
        runs = run_spmd(case.scenario)
    rec = runs[0].records[0][0]
    assert rec.capture.host["global_num_tokens_for_logprob_cpu"] == [rec.bs]  # baked wrong at capture
    assert rec.global_num_tokens_for_logprob_gpu == [rec.bs * 4]  # the replay fill is right...
    assert rec.rows_fed == rec.bs  # ...but the graph still used the baked host value


def test_graph_really_replays_and_counts():
    case = load_case("tp2_shrink")
    runs = run_spmd(case.scenario)
    for run in runs:
        n_steps = case.scenario.spec.num_steps
        assert run.stats.captures == n_steps * len(compute_capture_bs(case.layout, case.scenario.spec.capture_bs, 8))
        assert run.stats.replays == n_steps * len(case.schedule)
        assert run.stats.eager_fallbacks == 0


def test_eager_fallback_when_batch_exceeds_buckets():
    from harness.run.scenario import Iteration, RequestSpec, Scenario

    spec = SpecConfig(num_steps=2, capture_bs=(1, 2), max_running_requests=2)
    sc = Scenario(ModelConfig(), spec, PL(2), (Iteration((tuple(RequestSpec(i, 3, 1) for i in range(3)),)),))
    # max_running_requests 2 < 3 requests: the graph can't run, the driver falls back and says so
    runs = run_spmd(sc)
    assert all(r.stats.eager_fallbacks == 1 and r.stats.replays == 0 for r in runs)


def test_tp1_graph_is_bitwise_equal_to_eager():
    """At TP1 with raw_bs == bucket nothing differs between the paths: bitwise."""
    from harness.run.scenario import Iteration, RequestSpec, Scenario

    sc = Scenario(ModelConfig(), SPEC, PL(1), (Iteration((tuple(RequestSpec(i, 2 + i, 1 + i % 4) for i in range(4)),)),))
    run = run_spmd(sc)[0]
    # the graph ran: every step replayed bucket 4 (an eager fallback would compare eager with eager)
    assert run.stats.eager_fallbacks == 0 and run.stats.replays == len(run.graph[0]) > 0
    assert [rec.bs for rec in run.records[0]] == [4] * len(run.graph[0])
    for e, g in zip(run.eager[0], run.graph[0], strict=True):
        for k in ("logits", "hidden", "logprobs", "topk_index", "next_input_ids"):
            assert torch.equal(getattr(e.out, k), getattr(g.out, k)), k


def test_no_gc_during_capture_nests_across_threads_and_restores_the_collector():
    """Two overlapping captures (threads) keep the collector off until the last one ends; a
    collector that was already off stays off (runners/graph/backend.py's capture guard)."""
    import gc
    import threading

    from runners.graph.backend import no_gc_during_capture

    assert gc.isenabled()
    inside, release = threading.Event(), threading.Event()

    def other_capture():
        with no_gc_during_capture():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other_capture)
    with no_gc_during_capture():
        assert not gc.isenabled()
        t.start()
        assert inside.wait(10)
    assert not gc.isenabled(), "the other thread's capture is still running"
    release.set()
    t.join(10)
    assert gc.isenabled()

    gc.disable()
    try:
        with no_gc_during_capture():
            pass
        assert not gc.isenabled(), "the guard must not turn on a collector someone else turned off"
    finally:
        gc.enable()


def test_observed_driver_replays_the_same_outputs():
    """The observer (P1's host read-backs) changes nothing the runners compute: an unobserved run, as an engine's, gives the same outputs."""
    from harness.ranks.simulated import SimulatedWorld
    from harness.run.scenario import materialize, release

    sc = load_case("tp1_neither").scenario

    def rank(comm):
        driver = captured_driver(comm, sc)
        got = {}
        for observed in (True, False):
            observers = observe_all(driver.runners) if observed else []
            batch = materialize(driver.worker, sc, sc.iterations[1])
            got[observed] = [o.cloned() for o in driver.run(batch.inputs)], observers[0].take() if observers else []  # kept past the next run
            release(driver.worker, batch)
            for obs in reversed(observers):
                obs.detach()
        return got

    (got,) = SimulatedWorld(sc.layout).run(rank)
    (outs_rec, recs), (outs, no_recs) = got[True], got[False]
    assert len(recs) == len(outs_rec) == len(outs) > 0 and no_recs == []
    assert recs[0].raw_bs < recs[0].bs, "the case should pad (raw_bs below its bucket)"
    for a, b in zip(outs_rec, outs, strict=True):
        for name, t in a.tensors().items():
            assert torch.equal(t, b.tensors()[name]), name


def test_multi_layer_steps_share_one_buffer_set_filled_once_per_iteration():
    """As MultiLayerEagleMultiStepDraftExtendCudaGraphRunner: one buffer set for every step, the copy-in
    and replay fill once per iteration; step k > 0 replays over the chain inputs written between steps."""
    from unittest import mock

    from harness.ranks.simulated import SimulatedWorld
    from harness.run.scenario import materialize, release

    sc = load_case("tp1_neither").scenario
    fills = []
    real_fill = MultiLayerEagleDraftExtendCudaGraphRunner._fill_for_replay

    def counting_fill(self, inp):
        fills.append(self.step)
        return real_fill(self, inp)

    def rank(comm):
        driver = captured_driver(comm, sc)
        batch = materialize(driver.worker, sc, sc.iterations[1])
        with mock.patch.object(MultiLayerEagleDraftExtendCudaGraphRunner, "_fill_for_replay", counting_fill):
            outs = driver.run(batch.inputs)
        raw_n = batch.inputs.bs * driver.worker.tokens_per_bs
        last_chain = driver.runners[0].input_ids[:raw_n].clone()
        release(driver.worker, batch)
        return driver, outs, last_chain

    ((driver, outs, last_chain),) = SimulatedWorld(sc.layout).run(rank)
    assert len(driver.runners) == sc.spec.num_steps > 1
    assert all(r.buffers is driver.runners[0].buffers for r in driver.runners)
    assert fills == [0], "the shared buffers are filled once, by the first step's runner"
    assert torch.equal(last_chain, outs[-2].next_input_ids), "the last step read the step before's token ids"


def test_single_layer_runner_is_its_own_code():
    """I6 compares two implementations: the single-layer runner shares no get_forward_batch or fill with the multi-layer one."""
    assert not issubclass(EAGLEDraftExtendCudaGraphRunner, MultiLayerEagleDraftExtendCudaGraphRunner)
    for name in ("get_forward_batch", "_fill_for_replay", "replay"):
        assert getattr(EAGLEDraftExtendCudaGraphRunner, name) is not getattr(MultiLayerEagleDraftExtendCudaGraphRunner, name), name


def test_single_layer_padded_lanes_select_their_own_last_token():
    """Its reset differs from the multi-layer one where the engine's does: padded accept lengths T (select row T - 1)."""
    r = runner(PL(1), single=True)
    assert r.prepare_replay(inputs(3)) == 4
    assert r.num_correct_drafts[:4].tolist() == [1, 1, 1, 3] and r.num_accept_tokens[:4].tolist() == [2, 2, 2, 4]
    assert r.req_pool_indices[:4].tolist() == [1, 2, 3, 0] and r.seq_lens[:4].tolist() == [10, 10, 10, SEQ_LEN_FILL_VALUE]


def test_i6_compares_the_two_runners_codes():
    """A divergence in the single-layer runner's own get_forward_batch alone is what I6 sees."""
    from harness import mutants
    from harness.props.p1_metadata import check_metadata

    schedule = [[3, 1], [2, 5]]
    assert check_metadata(PL(4, 2, True), SPEC, schedule).ok
    with mutants.get("single-layer-capture-logprob-requests").planted():
        v = check_metadata(PL(4, 2, True), SPEC, schedule)
    assert "I6" in {f.check for f in v.failures}
