"""The harness's observer of our graph runners (harness.run.observe): what it takes, and that it leaves the runner as it found it."""
import torch

from harness.run.observe import RunnerObserver
from runners.config import ModelConfig, SpecConfig
from runners.draft_extend import DraftExtendInputs, DraftWorker
from runners.graph.backend import GraphBackend
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import MultiLayerEagleDraftExtendCudaGraphRunner
from runners.parallel.dp_attention import RankContext
from runners.parallel.layout import ParallelLayout as PL

SPEC = SpecConfig(num_steps=3, capture_bs=(1, 2, 4, 8), max_running_requests=8)  # T = 4
MLP_GATHER = PL(4, 2, True)


def _runner(layout=MLP_GATHER):
    w = DraftWorker(RankContext(layout, 0, comm=None), ModelConfig(), SPEC, build_model=False)
    return MultiLayerEagleDraftExtendCudaGraphRunner(w, 0, GraphBackend("sim"))


def _inputs(raw_bs, dp_sizes):
    n = raw_bs * 4
    return DraftExtendInputs(torch.arange(n), torch.arange(n), torch.full((raw_bs,), 10), torch.arange(1, raw_bs + 1),
                             torch.zeros(n, 64), torch.full((raw_bs,), 2), dp_sizes)


def test_capture_side_taken_at_capture_equals_the_metadata_only_bake():
    """Attached before capture, the observer keeps each bucket as get_forward_batch baked it; attached later
    (the loop's runners, captured at construction) it bakes the bucket itself: the two paths agree."""
    early = RunnerObserver(_runner()).attach()
    for bs in reversed(early.runner.capture_bs):  # what capture() does per bucket
        early.runner.get_forward_batch(bs)
    late = RunnerObserver(_runner())
    assert sorted(early.captures) == early.runner.capture_bs == [2, 4, 8]
    for bs in early.runner.capture_bs:
        assert late.capture_record(bs) == early.captures[bs]
    assert early.captures[4].global_num_tokens_for_logprob_gpu == [16, 16] and early.captures[4].host["global_dp_buffer_len"] == 32


def test_a_late_bake_keeps_the_live_replay_fill():
    """Baking a bucket writes the gathered tensors; the observer puts the replay fill back, so the graph reads the fill."""
    obs = RunnerObserver(_runner())
    r = obs.runner
    assert r.prepare_replay(_inputs(3, [3, 1])) == 4
    filled = (r.global_num_tokens_gpu.tolist(), r.global_num_tokens_for_logprob_gpu.tolist())
    assert filled == ([16, 16], [16, 16])
    assert obs.capture_record(8).global_num_tokens_gpu == [32, 32]  # another bucket, baked now
    assert (r.global_num_tokens_gpu.tolist(), r.global_num_tokens_for_logprob_gpu.tolist()) == filled


def test_attach_wraps_the_instance_only_and_detach_restores_it():
    observed, other = _runner(), _runner()
    cls = type(observed)
    before = {name: cls.__dict__.get(name) for name in ("get_forward_batch", "replay", "_replay_graph")}
    obs = RunnerObserver(observed).attach()
    other.get_forward_batch(2)
    assert obs.captures == {}  # another instance (another rank) is not observed
    observed.get_forward_batch(2)
    assert list(obs.captures) == [2]
    obs.detach()
    assert not {"get_forward_batch", "replay", "_replay_graph"} & set(vars(observed))
    assert {name: cls.__dict__.get(name) for name in before} == before
    observed.get_forward_batch(4)
    assert list(obs.captures) == [2]


def test_stacked_observers_detach_in_reverse_order():
    r = _runner()
    outer = RunnerObserver(r).attach()
    inner = RunnerObserver(r).attach()
    r.get_forward_batch(2)
    assert list(outer.captures) == list(inner.captures) == [2]
    inner.detach()
    r.get_forward_batch(4)
    assert list(outer.captures) == [2, 4] and list(inner.captures) == [2]
    outer.detach()
    assert "get_forward_batch" not in vars(r)
