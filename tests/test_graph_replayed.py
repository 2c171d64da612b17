"""A graph session whose runners never replay (every batch falls back to eager) is caught, never passed: the golden
checks of the loop compare a "graph" run with its goldens, and that run must have replayed its graphs."""
from __future__ import annotations

from contextlib import ExitStack
from unittest import mock

import pytest

from harness.cases.case import load_case
from harness.golden.draft_tree import check_tree_case
from harness.props.p6 import check_acceptance_case
from runners.decode_cuda_graph_runner import DecodeCudaGraphRunner
from runners.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
from runners.eagle_draft_extend_cuda_graph_runner import EAGLEDraftExtendCudaGraphRunner
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import MultiLayerEagleDraftExtendCudaGraphRunner

RUNNERS = (MultiLayerEagleDraftExtendCudaGraphRunner, EAGLEDraftExtendCudaGraphRunner, EAGLEDraftCudaGraphRunner, DecodeCudaGraphRunner)


@pytest.fixture
def no_graph_replays():
    """Every graph runner refuses every batch, as one whose buckets fit nothing would."""
    with ExitStack() as stack:
        for cls in RUNNERS:
            stack.enter_context(mock.patch.object(cls, "can_run", lambda self, inp: False))
        yield


@pytest.mark.parametrize("check,case", [(check_acceptance_case, "tp1_neither"), (check_tree_case, "tp2_single_layer_shrink")],
                         ids=["acceptance", "draft-tree"])
def test_a_golden_check_of_a_graph_run_that_never_replayed_fails(no_graph_replays, check, case):
    v = check(load_case(case))
    replayed = [f for f in v.failures if f.check == "replayed"]
    assert replayed, v.report()
    assert {f.field for f in replayed} >= {"graph replays > 0", "target verify replays > 0"}
