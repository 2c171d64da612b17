"""The cases of the loop's features (logprobs, mixed DP modes, overlap) are where every collection finds them: shipped,
with their features on, their goldens recorded for them, nothing skipped, and a probe and mutants of their own."""
import pytest

from harness.cases.case import default_cases, load_case
from harness.golden.acceptance import GOLDEN_CASES, load_acceptance_golden
from harness.golden.logprobs import LOGPROB_CASES
from harness.mutants import CATALOG
from harness.pipeline.mutants import probes, probes_for
from harness.props import registry
from harness.run.loop import spec_skip_reason

FEATURES = {
    "tp2_dp2_logprobs": (lambda c: c.top_logprobs_num is not None, "logprob-case", "logprob-", "P5"),
    "tp3_dp3_mixed_modes": (lambda c: c.scenario.spec.dp_spec_prefill_coordination, "mixed-modes-case", "mixed-", "P7"),
    "tp2_dp2_overlap": (lambda c: c.scenario.spec.overlap_schedule, "overlap-case", "overlap-", "P5"),
}


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_a_feature_case_is_checked_everywhere_cases_are(name):
    enabled, probe, prefix, prop = FEATURES[name]
    case = load_case(name)
    assert enabled(case)
    assert name in {c.name for c in default_cases()}  # `harness check` and the plugin's items: every case in cases/
    assert spec_skip_reason(case) is None  # P2/P5/P6 run on it, `--props all` skips nothing
    assert name in GOLDEN_CASES and load_acceptance_golden(case)["case"] == name  # recorded with the feature on
    assert (name in LOGPROB_CASES) == (case.top_logprobs_num is not None)
    assert probe in {p.id for p in probes()} and probe in {p.id for p in registry.get(prop).probes}  # the property it serves
    mine = [m for m in CATALOG if m.id.startswith(prefix)]
    assert mine and all(m.probes == (probe,) and probes_for(m) for m in mine)
