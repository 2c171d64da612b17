"""The ragged draft-extend with a backend that plans on the host (torch_planned, flashinfer) is refused, by the case
loader (the field and the rule) and by the driver (the API path): its graph would replay the extents of its capture
where every replay's accepted tokens change them, and a wrong run is worse than none."""
from __future__ import annotations

import tomllib
from types import SimpleNamespace

import pytest

from harness.cases.case import CASES_DIR, CaseError, parse_case
from runners.config import SpecConfig
from runners.draft_extend_graph_driver import DraftExtendGraphDriver

RAGGED_CASE = CASES_DIR / "tp2_ragged_draft_extend.toml"


@pytest.mark.parametrize("backend", ["torch_planned"])
def test_the_case_loader_names_the_field_and_the_backends_that_work(backend):
    data = tomllib.loads(RAGGED_CASE.read_text())
    data["backend"] = backend
    with pytest.raises(CaseError) as e:
        parse_case(data, RAGGED_CASE)
    assert e.value.field == "spec.draft_extend_shape"
    assert f"fixed with backend = {backend}" in str(e.value) and "(torch, triton)" in str(e.value)


def test_the_shipped_ragged_case_loads_with_the_reference_backend():
    assert parse_case(tomllib.loads(RAGGED_CASE.read_text()), RAGGED_CASE).scenario.spec.draft_extend_shape == "ragged"


@pytest.mark.parametrize("backend", ["torch_planned", "flashinfer"])
def test_the_driver_refuses_a_host_planned_backend(backend):
    worker = SimpleNamespace(spec=SpecConfig(draft_extend_shape="ragged"), attn=SimpleNamespace(name=backend))
    with pytest.raises(ValueError, match=f"attention backend {backend}: the ragged draft-extend needs"):
        DraftExtendGraphDriver(worker, backend=None)
