"""The TARGET_VERIFY graph runner: per-branch capture metadata (by hand), buckets and the replay
fill, eager vs graph on one pass, its use by the spec loop, and the mutants its properties kill."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness import mutants
from harness.cases.case import load_case
from harness.props.p1_metadata import check_metadata
from harness.props.p5 import check_spec_case
from harness.props.verify_shadow import VerifyShadow
from harness.ranks.simulated import SimulatedWorld
from harness.run.loop import SpecSession, Workload, run_workload
from harness.run.observe import RunnerObserver
from harness.verdict import Verdict
from runners.config import ModelConfig, SpecConfig
from runners.decode_cuda_graph_runner import DecodeCudaGraphRunner, VerifyInputs, verify_inputs
from runners.graph.backend import GraphBackend
from runners.memory import PADDING_SLOT, ReqToTokenPool
from runners.parallel.dp_attention import RankContext
from runners.parallel.layout import ParallelLayout as PL
from runners.target import Lane, TargetRunner

SPEC = SpecConfig(num_steps=3, capture_bs=(1, 2, 4, 8), max_running_requests=8)  # T = 4
MODEL = ModelConfig()


def metadata_runner(layout, tp_rank=0, spec=SPEC):
    return DecodeCudaGraphRunner(RankContext(layout, tp_rank, comm=None), MODEL, spec, None, GraphBackend("sim"))


def inputs(raw_bs, T=4, dp_sizes=None, seq=10):
    n = raw_bs * T
    return VerifyInputs(torch.arange(100, 100 + n), torch.arange(n), torch.full((raw_bs,), seq), torch.arange(1, raw_bs + 1),
                        dp_sizes or [raw_bs])


# bs = 4, T = 4 (N = 16), dp = 2, by hand: every count is tokens, and every token gets logits
@pytest.mark.parametrize(
    "layout,gnt,buf",
    [
        (PL(4, 2, True), [16, 16], 32),  # MLP-TP gather: [N] * dp, buffer N * dp
        (PL(4, 2, True, 1, True, "deepep"), [16], 16),  # attn-TP gather: [N]
        (PL(4, moe_dense_tp_size=1), [16], 16),
        (PL(4), None, None),  # neither
    ],
    ids=["mlp", "attn-dp", "attn", "neither"],
)
def test_get_forward_batch_per_branch(layout, gnt, buf):
    fb = metadata_runner(layout).get_forward_batch(4)
    assert fb.forward_mode.is_target_verify() and fb.batch_size == 4 and fb.num_tokens == 16
    assert fb.extend_seq_lens_cpu == [4] * 4 and fb.extend_start_loc.tolist() == [0, 4, 8, 12]
    assert fb.global_num_tokens_cpu == gnt and fb.global_num_tokens_for_logprob_cpu == gnt
    assert fb.global_dp_buffer_len == buf
    if gnt is None:
        assert fb.global_num_tokens_gpu is None
    else:
        assert fb.global_num_tokens_gpu.tolist() == gnt and fb.global_num_tokens_for_logprob_gpu.tolist() == gnt


def test_replay_fill_after_a_shrink():
    r = metadata_runner(PL(4, 2, True))
    observer = RunnerObserver(r)
    rec = observer.prepare(inputs(6, dp_sizes=[6, 2]))
    assert (rec.raw_bs, rec.bs) == (6, 8)
    rec = observer.prepare(inputs(1, dp_sizes=[1, 3]))  # the MLP-TP gather branch pads to the largest group's bucket
    assert (rec.raw_bs, rec.bs) == (1, 4)
    assert r.input_ids[:4].tolist() == [100, 101, 102, 103] and r.req_pool_indices[:1].tolist() == [1]
    # the bucket's padded lanes 1-3 get the fill over the stale batch of 6; lanes 4-7 are past the bucket (never
    # read) and keep what the bucket of 8 left: lanes 4 and 5 live, 6 and 7 padded
    assert r.seq_lens.tolist() == [10, 1, 1, 1, 10, 10, 1, 1]
    assert r.req_pool_indices.tolist() == [1, 0, 0, 0, 5, 6, 0, 0]
    assert r.positions[4:16].tolist() == [0] * 12 and r.input_ids[4:16].tolist() == [0] * 12
    assert r.input_ids[16:].tolist() == list(range(116, 124)) + [0] * 8 and r.positions[16:24].tolist() == list(range(16, 24))
    # out_cache_loc has no replay fill: the body writes every row of the bucket before a KV write (runners.decode_cuda_graph_runner)
    assert r.global_num_tokens_gpu.tolist() == [16, 16]
    assert rec.padded_seq_lens == [1, 1, 1] and rec.seq_lens_sum == rec.seq_lens_sum_actual == 13


def test_buckets_are_aligned_by_tokens_on_attn_tp():
    """tp8 attn-TP gather, T = 4: the engine keeps bs 2 and 4 (8 and 16 tokens split over 8 ranks), so a batch of 1 replays at 2."""
    layout = PL(8, moe_dense_tp_size=1)
    r = metadata_runner(layout)
    assert r.capture_bs == [2, 4, 8]
    rec = RunnerObserver(r).prepare(inputs(1))
    assert (rec.raw_bs, rec.bs) == (1, 2) and r.global_num_tokens_gpu.tolist() == [8]
    assert check_metadata(layout, SPEC, [(1,), (3,), (8,)]).ok


def test_can_run_falls_back_past_the_largest_bucket():
    r = metadata_runner(PL())
    assert r.can_run(inputs(8)) and not r.can_run(inputs(9))
    dp = metadata_runner(PL(2, 2, True))
    assert not dp.can_run(inputs(1, dp_sizes=[1, 9]))  # another DP group's batch decides the bucket


def _one_rank_pass(raw_bs: int):
    """Eager verify and graph replay of one TP1 rank from the same KV state: (eager, graph, KV after each)."""
    T, cfg = SPEC.num_tokens_per_bs, MODEL

    def fn(comm):
        ctx = RankContext(PL(), 0, comm)
        pool = ReqToTokenPool(16, cfg.max_context_len, torch.device("cpu"))
        target = TargetRunner(ctx, cfg, pool, 1 + 16 * cfg.max_context_len, torch.device("cpu"))
        g = torch.Generator().manual_seed(3)
        lanes, at = [], 1
        for i in range(raw_bs):  # a prefilled prefix of 5 + i tokens, then a verify of T tokens
            idx, L = pool.alloc(), 5 + i
            pool.req_to_token[idx, : L + T] = torch.arange(at, at + L + T)
            toks = torch.randint(0, cfg.vocab_size, (L + T,), generator=g).tolist()
            target.forward([Lane(idx, 0, toks[:L])])
            lanes.append(Lane(idx, L, toks[L:]))
            at += L + T
        runner = DecodeCudaGraphRunner(ctx, cfg, SPEC, target, GraphBackend("sim"))
        observer = RunnerObserver(runner).attach()
        runner.capture()
        kv = target.kv_pool
        before = [t.clone() for t in kv.k + kv.v]
        eager = target.forward(lanes)
        eager_kv = [t.clone() for t in kv.k + kv.v]
        for dst, src in zip(kv.k + kv.v, before, strict=True):
            dst.copy_(src)
        graph = runner.replay(verify_inputs(lanes, [raw_bs], torch.device("cpu")))
        return eager, graph, observer.replays[-1], eager_kv, [t.clone() for t in kv.k + kv.v]

    return SimulatedWorld(PL()).run(fn)[0]


def test_eager_and_graph_verify_agree_on_real_rows_at_a_padded_bucket():
    eager, graph, rec, eager_kv, graph_kv = _one_rank_pass(3)
    assert (rec.raw_bs, rec.bs) == (3, 4) and graph.logits.shape == eager.logits.shape == (12, MODEL.vocab_size)
    # eager_vs_graph on CPU fp32: GEMM blocking depends on the padded M (harness/props/tolerances.py)
    torch.testing.assert_close(graph.logits, eager.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(graph.hidden, eager.hidden, rtol=1e-5, atol=1e-5)
    assert int(graph.rows_fed) == 16  # the whole bucket reached lm_head
    for a, b in zip(eager_kv, graph_kv, strict=True):  # the padded lane wrote only the padding slot
        torch.testing.assert_close(b[PADDING_SLOT + 1 :], a[PADDING_SLOT + 1 :], rtol=1e-5, atol=1e-5)


def test_the_loop_verifies_through_the_graph_and_the_shadow_sees_every_replay():
    shadows = []
    wl = Workload(((6,), (3,), (1,)), rounds_per_phase=2)  # buckets 8 -> 4 -> 1
    s = run_workload(SpecSession(PL(), SPEC, runner="graph", hook=lambda e: shadows.append(VerifyShadow(e, Verdict("P3"), Verdict("P1")))), wl)
    (sh,) = shadows
    stats = sh.engine.verify_graph.backend.stats
    verifies = sum(len(recs[0].verify) for recs in s.records)
    assert stats.replays == sh.replays == verifies > 0 and stats.eager_fallbacks == 0
    assert {(r.raw_bs, r.bs) for recs in s.records for r in recs[0].verify} >= {(6, 8), (3, 4)}
    assert sh.p3 and sh.p1, (sh.p3.report(), sh.p1.report())
    assert sh.p3.checked > 0 and sh.p1.checked > 0


def test_a_tree_engine_verifies_through_the_graph():
    shadows = []
    spec = SpecConfig(num_steps=2, topk=2, num_draft_tokens=5, capture_bs=(1, 2, 4), max_running_requests=4)
    hook = lambda e: shadows.append(VerifyShadow(e, Verdict("P3"), Verdict("P1"), Verdict("P5")))  # noqa: E731
    s = run_workload(SpecSession(PL(), spec, runner="graph", hook=hook), Workload(((4,), (2,)), rounds_per_phase=2))
    (sh,) = shadows
    assert s.engines[0].tree and sh.engine.verify_graph.T == 5 and sh.replays > 0
    assert sh.p3 and sh.p1 and sh.p5, (sh.p3.report(), sh.p5.report())
    assert sh.p5.checked > 0  # the siblings' logits were compared with their paths as chains


class HostSyncs(TorchDispatchMode):
    """Records the ops that read a device value on the host or size a result by the data."""

    SYNCING = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_dim"}

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.SYNCING:
            self.seen.add(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layout", [PL(), PL(2, 2, True), PL(2, 2, True, 1, True, "deepep")], ids=["tp1", "mlp", "attn-dp"])
def test_the_graph_body_has_no_host_sync(layout):
    """What a real CUDA graph can't capture: .item() / int(tensor) / data-dependent shapes in the body."""
    with HostSyncs() as probe:
        int(torch.ones(2).sum()), torch.arange(3).nonzero()  # the detector sees both kinds
    assert probe.seen == {"aten::_local_scalar_dense", "aten::nonzero"}

    def fn(comm):
        ctx, dev = RankContext(layout, comm.rank, comm), torch.device("cpu")
        target = TargetRunner(ctx, MODEL, ReqToTokenPool(8, MODEL.max_context_len, dev), 64, dev)
        runner = DecodeCudaGraphRunner(ctx, MODEL, SPEC, target, GraphBackend("sim"))
        fb = runner.get_forward_batch(4).frozen()
        with HostSyncs() as seen:
            runner._body(fb)
        return seen.seen

    assert SimulatedWorld(layout).run(fn) == [set()] * layout.world_size


# ---------------------------------------------------------------- mutants


def test_p1_kills_stale_padded_seq_lens_of_the_verify_runner():
    with mutants.get("verify-stale-padded-seq-lens").planted():
        v = check_metadata(PL(), SPEC, [(6,), (3,)])  # bucket 8, then 4: lane 3 is padded and stale
    bad = [f for f in v.failures if f.where.get("runner") == "target_verify"]
    assert bad and bad[0].field == "padded seq_lens" and bad[0].expected == [1], v.report()
    assert bad[0].got[0] >= SPEC.num_tokens_per_bs  # iteration 0's length of lane 3
    assert all(f.where.get("runner") == "target_verify" for f in v.failures)  # the draft-extend runners are untouched


TREE_SPEC = SpecConfig(num_steps=1, topk=2, num_draft_tokens=3, capture_bs=(1, 2, 4, 8))  # T = 3: trees other than the chain


@pytest.mark.parametrize("mutant", [None, "verify-host-mask-stale-padded", "verify-stale-padded-mask"])
def test_p1_sees_a_padded_tree_mask_left_stale_on_the_host_or_the_device(mutant):
    """A tree batch of 6 (bucket 8), then 3 (bucket 4): lane 3 held a tree, and the fill writes the chain mask
    to one of the host mirror and the device buffer only, so the two differ there."""
    if mutant is None:
        v = check_metadata(PL(), TREE_SPEC, [(6,), (3,)])
        assert v.ok and v.checked, v.report()
        return
    with mutants.get(mutant).planted():
        v = check_metadata(PL(), TREE_SPEC, [(6,), (3,)])
    assert [(f.where.get("runner"), f.field, f.got) for f in v.failures] == [("target_verify", "host mirror", [3])], v.report()


@pytest.mark.parametrize(("mutant", "field", "expected", "got"), [
    ("verify-buckets-request-aligned", "capture_bs", [2, 4, 8], [8]),
    ("verify-bucket-tokens-unsplit", "capture_bs", [2, 4, 8], [1, 2, 4, 8]),
])
def test_p1_kills_verify_buckets_off_the_token_rule(mutant, field, expected, got):
    with mutants.get(mutant).planted():
        v = check_metadata(PL(8, moe_dense_tp_size=1), SPEC, [(1,)])
    bad = [f for f in v.failures if f.where.get("runner") == "target_verify"]
    assert bad and (bad[0].field, bad[0].expected, bad[0].got) == (field, expected, got), v.report()
    assert all(f.where.get("runner") == "target_verify" for f in v.failures)  # the draft runners keep their buckets
    fields = {f.field for f in bad}
    assert ("bs * T % attn_tp_size" in fields) == (mutant == "verify-bucket-tokens-unsplit"), fields  # bucket 1: 4 tokens over 8 ranks


def test_p3_and_p5_kill_a_padded_kv_write_into_a_stale_slot():
    with mutants.get("verify-padded-kv-write-stale-slot").planted():
        v = check_spec_case(load_case("tp2_shrink"), runners=("graph",))
    assert not v["P3"] and not v["P5"]
    f = v["P3"].failures[0]
    assert f.where["runner"] == "target_verify" and f.where["raw_bs"] < f.where["bs"], f.message()


def test_p1_p3_p5_kill_a_gathered_fill_in_requests():
    with mutants.get("verify-gathered-tokens-requests").planted():
        meta = check_metadata(PL(2, 2, True), SPEC, [(3, 2)])
        v = check_spec_case(load_case("tp4_dp2_mlp_tp_gather"), runners=("graph",))
    fill = [f for f in meta.failures if f.check == "fill"]
    assert fill and fill[0].expected == [16, 16] and fill[0].got == [4, 4], meta.report()
    assert not v["P1"] and not v["P3"] and not v["P5"]


def test_the_fill_mutants_leave_the_eager_loop_alone():
    """They break the verify graph's fill only: the eager engine (the reference) is untouched."""
    for mid in ("verify-padded-kv-write-stale-slot", "verify-gathered-tokens-requests"):
        with mutants.get(mid).planted():
            v = check_spec_case(load_case("tp1_neither"), runners=("eager",))
        assert v["P5"] and v["P6"], mid
