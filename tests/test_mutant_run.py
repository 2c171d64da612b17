"""The mutant runner: verdicts independent of --jobs, a dead or hung child is an error and never a kill,
stop-at-first-kill says what it did not run, every catalog mutant names registered probes and plants cleanly."""
import pkgutil
from inspect import getattr_static

import pytest

from harness.mutants import CATALOG, Mutant
from harness.pipeline.mutants import load_catalog, probes, probes_for, run_catalog

FIXTURES = "tests.helpers.mutant_fixtures:CATALOG"  # the repo root is on sys.path under pytest, so the children import it too


def _verdicts(results):
    return [(r.id, r.status, r.killed_by, r.killing_probe) for r in results]


def test_jobs_do_not_change_verdicts_and_results_come_in_catalog_order():
    only = ["seed-bug", "no-bug"]
    seen = []
    one = run_catalog(only, jobs=1, catalog=FIXTURES)
    two = run_catalog(only, on_result=seen.append, jobs=2, catalog=FIXTURES)
    assert _verdicts(one) == _verdicts(two) == [("seed-bug", "killed", "P1", "metadata-grid"), ("no-bug", "survived", None, None)]
    assert sorted(r.id for r in seen) == sorted(only)  # streamed: each result once, in completion order


def test_first_kill_stops_and_says_what_was_not_run():
    (r,) = run_catalog(["seed-bug-two-probes"], catalog=FIXTURES)
    assert r.killed and r.killing_probe == "metadata-grid"
    assert r.probes_run == ["metadata-grid"] and r.probes_not_run == ["p7-idle-ranks"]
    (full,) = run_catalog(["seed-bug-two-probes"], all_properties=True, catalog=FIXTURES)
    assert full.killed_by == "P1" and full.probes_run == ["metadata-grid", "p7-idle-ranks"] and full.probes_not_run == []


def test_a_child_that_dies_is_an_error_naming_the_mutant_not_a_kill():
    fine, r = run_catalog(["seed-bug", "child-exits"], jobs=2, catalog=FIXTURES)  # catalog order
    assert (fine.id, fine.status) == ("seed-bug", "killed")  # the other child is unaffected
    assert r.id == "child-exits" and r.status == "error" and not r.killed and r.killed_by is None
    assert "child-exits" in r.error and "exit code 3" in r.error


def test_a_hung_child_is_stopped_at_its_timeout_and_reported_as_an_error():
    (r,) = run_catalog(["child-hangs"], timeout_s=3.0, catalog=FIXTURES)
    assert r.status == "error" and not r.killed and "timeout" in r.error


def test_a_probe_that_raises_is_an_error_not_a_kill():
    (r,) = run_catalog(["probe-raises"], catalog=FIXTURES)
    assert r.status == "error" and not r.killed
    assert "probe metadata-grid raised RuntimeError: the harness itself broke" in r.error


def test_every_catalog_mutant_names_registered_probes():
    for m in CATALOG:
        assert probes_for(m), m.id
    with pytest.raises(KeyError, match="no-such-probe"):
        probes_for(Mutant("x", "d", "k", (), ("metadata-grid", "no-such-probe")))


def test_every_catalog_mutant_plants_and_unplants_where_its_code_is():
    """Every patch target resolves (a runner moved or renamed without its mutants fails here, not in a child process),
    the planted attribute is the mutant's, and unplanting gives back the real one."""
    for m in CATALOG:
        spots = [(pkgutil.resolve_name(t) if isinstance(t, str) else t, attr) for t, attr, _ in m.patches]
        real = [getattr_static(t, attr) for t, attr in spots]  # static: a classmethod binds anew at every getattr
        with m.planted():
            assert all(getattr_static(t, attr) is not r for (t, attr), r in zip(spots, real, strict=True)), m.id
        assert all(getattr_static(t, attr) is r for (t, attr), r in zip(spots, real, strict=True)), m.id


def test_a_mutant_without_probes_gets_every_probe_whole_cases_last():
    names = [p.id for p in probes_for(Mutant("x", "d", "k"))]
    assert sorted(names) == sorted(p.id for p in probes()) and names[-1] == "cases" and names[0] == "metadata-grid"


def test_fixture_catalog_loads():
    assert [m.id for m in load_catalog(FIXTURES)][:2] == ["seed-bug", "no-bug"]
