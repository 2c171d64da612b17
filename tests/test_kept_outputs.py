"""Graph outputs are poisoned after each engine step of a graphed session (harness/run/kept_outputs.py): a view kept past
its step reads poison, a copy does not, and the runners never read it (the next replay writes its outputs whole)."""
import torch

from harness.run.kept_outputs import poison_tensor
from harness.run.loop import SpecSession, request_prompt
from runners.config import DEFAULT_MODEL, SpecConfig
from runners.parallel.layout import ParallelLayout

SPEC = SpecConfig(num_steps=2, topk=1, capture_bs=(1, 2), max_running_requests=2, draft="single_layer")


def _adds(n: int, first: int = 0) -> list[tuple]:
    return [("add", rid, *request_prompt(0, rid, DEFAULT_MODEL.vocab_size), 0) for rid in range(first, first + n)]


def test_poison_by_dtype():
    f, i, b = torch.ones(3), torch.arange(3), torch.tensor([True, False])
    for t in (f, i, b):
        poison_tensor(t)
    assert f.isnan().all() and (i == torch.iinfo(torch.int64).min).all() and b.tolist() == [False, True]


def test_after_a_step_every_graph_output_is_poisoned_and_the_report_holds_copies():
    s = SpecSession(ParallelLayout(), SPEC, runner="graph")
    (poison,) = s.output_poison
    assert {type(r).__name__ for r in poison.runners} == {"EAGLEDraftExtendCudaGraphRunner", "DecodeCudaGraphRunner", "EAGLEDraftCudaGraphRunner"}
    s.step(_adds(2))
    rep = s.step()[0]
    assert rep.extend_outs and rep.decode_outs is not None  # the step replayed the draft graphs
    outputs = list(poison.graph_outputs())
    assert outputs and poison.poisoned >= 2 * len(outputs)
    for t in outputs:
        assert (t.isnan().all() if t.dtype.is_floating_point else (t == torch.iinfo(t.dtype).min).all()), t.dtype
    kept = [*rep.extend_outs[0].tensors().values(), *rep.decode_outs.tensors().values()]
    assert all(not (t.dtype.is_floating_point and t.isnan().any()) for t in kept)  # the loop's copies, untouched
    assert all((t >= 0).all() for t in (rep.extend_outs[0].topk_index, rep.decode_outs.tokens))


def test_a_poisoned_session_runs_on_as_the_eager_one():
    """The runners never read a poisoned output: the graph session's tokens are the eager session's."""
    eager, graph = SpecSession(ParallelLayout(), SPEC, runner="eager"), SpecSession(ParallelLayout(), SPEC, runner="graph")
    for cmds in (_adds(2), (), [("finish", 0), *_adds(1, first=2)], ()):  # 2, 2, then 2 again with a new request
        eager.step(cmds)
        graph.step(cmds)
    assert {r: q.tokens for r, q in graph.requests().items()} == {r: q.tokens for r, q in eager.requests().items()}
    assert graph.output_poison[0].poisoned > 0 and not eager.output_poison[0].poisoned
