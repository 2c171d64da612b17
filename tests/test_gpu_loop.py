"""The speculative-decoding loop on the GPU (marker `gpu`): the scheduler, the KV book and every graphed runner
of a rank (draft-extend, single-layer draft decode, target verify) under real CUDA graphs in one pool, on tp1.

P2 poisons the padded lanes and every stale KV slot with NaN (harness.props.p2): on the GPU that also reaches the
kernels, so an attention kernel that lets a masked (padding or stale) key through as `0 * NaN` shows here, where the
CPU suite only runs the torch and interpreted-Triton kernels. P5: the run's tokens are the target's greedy tokens.
"""
from __future__ import annotations

import pytest

from harness.props.p2 import check_padded_lanes
from harness.props.p5 import check_spec_case
from runners.attention.kinds import METADATA_IN_GRAPH
from tests.test_gpu import _assert_ok, _need, make_case

GRID = [("torch", "default"), ("triton", "default"), ("flashinfer", "hd64")]  # flashinfer: no head_dim-8 kernels
DRAFTS = {  # the spec keys of each draft; single_layer adds the graphed draft decode, one_graph SGLang's one-graph draft-extend
    "multi_layer": {"draft": "multi_layer"},
    "one_graph": {"draft": "multi_layer", "draft_extend_graph": "one_graph"},
    "single_layer": {"draft": "single_layer"},
}
SHRINK = ([5], [3], [1])  # buckets 8 -> 4 -> 1: padded lanes in every phase, and lanes a larger batch left
# the one graph needs a backend that builds its metadata in the graph (runners.attention.kinds.METADATA_IN_GRAPH)
RUNS = [(b, m, d) for b, m in GRID for d in DRAFTS if d != "one_graph" or b in METADATA_IN_GRAPH]
@pytest.mark.gpu
@pytest.mark.parametrize("backend,model,draft", RUNS, ids=[f"{b}-{d}" for b, _, d in RUNS])
def test_padded_lanes_and_lossless_loop_with_real_cuda_graphs(backend, model, draft):
    _need(backend)
    case = make_case("tp1", backend, "float32", model, batches=SHRINK, **DRAFTS[draft])
    v = check_padded_lanes(case, device="cuda")
    _assert_ok(*v.values())
    _assert_ok(*check_spec_case(case, props=("P5",), device="cuda").values())
