"""The property registry: every property is one registered object, and `harness check`, `harness replay`, the pytest
plugin, the mutant runner and the docs table pick up a new one with no other edit (shown with a throwaway P99)."""
from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from harness.cases.case import CASES_DIR, load_case
from harness.mutants import Mutant
from harness.pipeline.check import check_case
from harness.pipeline.mutants import probes, probes_for, run_mutant
from harness.pipeline.replay import replay_case
from harness.props import registry
from harness.props.base import Needs, Probe, Property
from harness.verdict import Verdict
from tests.helpers.prewarmed import run_module

REPO = Path(__file__).resolve().parent.parent


def test_every_property_has_one_module_and_a_unique_id_in_id_order():
    props = registry.properties()
    assert [p.id for p in props] == ["P1", "P2", "P3", "P4", "P5", "P6", "P7", "P8", "sim-vs-real"]
    assert {p.check.__module__ for p in props if p.check} == {f"harness.props.p{k}" for k in range(1, 7)}
    assert [i.id for i in registry.get("P1").invariants] == [f"I{k}" for k in range(1, 8)]
    assert registry.default_ids() == ("P1", "P3", "P4") and registry.case_ids() == ("P1", "P3", "P4", "P2", "P5", "P6")
    assert [p.id for p in registry.elsewhere()] == ["P7", "P8", "sim-vs-real"]
    assert registry.kill_order()[-1] == "run" and registry.report_order()[0] == "run"


def test_props_all_names_what_a_case_check_does_not_run():
    assert registry.parse_props("all") == registry.case_ids()
    with pytest.raises(ValueError) as e:
        registry.parse_props("P1,P7")
    assert "unknown: P7" in str(e.value) and "P7 (uneven DP load) runs under pytest and `harness mutants`" in str(e.value)
    assert "P8 (batch churn) runs under pytest" in registry.props_help()


def test_a_property_needs_a_case_check_exactly_when_it_runs_per_case():
    with pytest.raises(TypeError, match="say where it runs"):
        Property("PX", "x", Needs.SCHEDULES)
    with pytest.raises(TypeError, match="a check over one case"):
        Property("PX", "x", Needs.CASE_RUN)


def _throwaway(kill: bool = False) -> Property:
    """P99 reads the shared case run (one verdict per rank run); its probe fails when `kill`."""

    def check(run) -> dict[str, Verdict]:
        return {"P99": Verdict("P99", checked=len(run.runs))}

    def probe() -> dict[str, Verdict]:
        v = Verdict("P99", checked=1)
        if kill:
            v.fail("throwaway", "field", {"probe": "p99-probe"}, 1, 2)
        return {"P99": v}

    return Property("P99", "a throwaway property", Needs.CASE_RUN, check, probes=(Probe("p99-probe", probe),))


def test_a_registered_property_is_checked_replayed_probed_and_documented_with_no_other_edit():
    case = load_case("tp1_neither")
    with registry.registered(_throwaway(kill=True)):
        assert "P99" in registry.default_ids() and "| P99 | a throwaway property |" in registry.markdown()
        rep = check_case(case)
        assert set(rep.verdicts) == {"P1", "P3", "P4", "P99"} and rep.verdicts["P99"].checked == 1 and rep.ok
        assert replay_case(case).report.verdicts["P99"].checked == 1  # replay judges through the same pipeline
        assert "p99-probe" in [p.id for p in probes()] and "p99-probe" in [p.id for p in probes_for(Mutant("m", "d", "k"))]
        result = run_mutant(Mutant("m", "a planted nothing", "test", (), ("p99-probe",)))
        assert (result.killed_by, result.killing_probe) == ("P99", "p99-probe")
    assert "P99" not in registry.default_ids()  # gone with the block


def test_the_plugin_collects_and_runs_a_registered_property(tmp_path):
    cases = tmp_path / "cases"
    cases.mkdir()
    (cases / "tp1_neither.toml").write_text((CASES_DIR / "tp1_neither.toml").read_text())
    project = tmp_path / "project"
    project.mkdir()
    (project / "conftest.py").write_text(textwrap.dedent("""
        from harness.props import registry
        from harness.props.base import Needs, Property
        from harness.verdict import Verdict

        registry.register(Property("P99", "a throwaway property", Needs.CASE_RUN, lambda run: {"P99": Verdict("P99", checked=len(run.runs))}))
        pytest_plugins = ["harness.plugin"]
    """))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    p = run_module("pytest", "-q", "-p", "no:randomly", "-rA", f"--specharness-cases-dir={cases}", "-k", "P99", cwd=project, env=env,
                   fresh=("harness",), timeout=280)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "PASSED .::specharness::tp1_neither::P99" in out, out[-3000:]
