"""The mutant runner: verdicts independent of --jobs, a dead or hung child is an error and never a kill,
stop-at-first-kill says what it did not run, a probe made of parts runs part by part, every catalog mutant names
registered probes and plants cleanly."""
import pkgutil
from inspect import getattr_static

import pytest
import torch

from harness.mutants import CATALOG, Mutant
from harness.pipeline.mutants import load_catalog, probes, probes_for, run_catalog, run_mutant
from harness.props import registry
from harness.props.base import Needs, Probe, Property
from harness.props.p1 import GRID_TP_SIZES
from harness.run.layouts import all_layouts
from harness.verdict import Verdict

FIXTURES = "tests.helpers.mutant_fixtures:CATALOG"  # the repo root is on sys.path under pytest, so the children import it too
# The fixtures name the whole metadata grid, a part per spec and TP size; their one layout is TP2, so the TP1 part
# checks nothing and the chains' TP2 part is the one that sees the seed bug.
GRID_TP1, GRID_TP2 = "metadata-grid:chains-tp1", "metadata-grid:chains-tp2"


def _verdicts(results):
    return [(r.id, r.status, r.killed_by, r.killing_probe) for r in results]


def test_jobs_do_not_change_verdicts_and_results_come_in_catalog_order():
    only = ["seed-bug", "no-bug"]
    seen = []
    one = run_catalog(only, jobs=1, catalog=FIXTURES)
    two = run_catalog(only, on_result=seen.append, jobs=2, catalog=FIXTURES)
    assert _verdicts(one) == _verdicts(two) == [("seed-bug", "killed", "P1", GRID_TP2), ("no-bug", "survived", None, None)]
    assert sorted(r.id for r in seen) == sorted(only)  # streamed: each result once, in completion order


def test_first_kill_stops_at_the_killing_part_and_says_what_was_not_run():
    grid = [p.id for p in METADATA_GRID_PARTS]
    (r,) = run_catalog(["seed-bug-two-probes"], catalog=FIXTURES)
    assert r.killed and r.killing_probe == GRID_TP2
    assert r.probes_run == [GRID_TP1, GRID_TP2] and r.probes_not_run == grid[2:] + ["p7-idle-ranks"]
    assert [p.failed for p in r.probes] == [[], ["P1"]]
    (full,) = run_catalog(["seed-bug-two-probes"], all_properties=True, catalog=FIXTURES)
    assert full.killed_by == "P1" and full.probes_run == grid + ["p7-idle-ranks"] and full.probes_not_run == []
    assert {p.probe for p in full.probes if p.failed} == {GRID_TP2, "metadata-grid:trees-tp2"}  # the kill matrix, by part


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
    assert f"probe {GRID_TP1} raised RuntimeError: the harness itself broke" in r.error


def test_every_catalog_mutant_names_registered_probes():
    for m in CATALOG:
        assert probes_for(m), m.id
    with pytest.raises(KeyError, match="no-such-probe"):
        probes_for(Mutant("x", "d", "k", (), ("metadata-grid", "no-such-probe")))


def test_every_catalog_mutant_starts_with_one_run():
    """A mutant's first probe is one case or run, never a probe made of parts nor every probe (no list): the catalog's
    run grows by the cheapest probe that kills each new mutant, not by a whole case set (its list goes on with the
    wholes, for the kill matrix)."""
    known = {p.id: p for p in probes()}
    assert not [m.id for m in CATALOG if m.probes is None or known[m.probes[0]].parts]


def test_every_catalog_mutant_plants_and_unplants_where_its_code_is():
    """Every patch target resolves (a runner moved or renamed without its mutants fails here, not in a child process),
    the planted attribute is the mutant's, and unplanting gives back the real one."""
    for m in CATALOG:
        spots = [(pkgutil.resolve_name(t) if isinstance(t, str) else t, attr) for t, attr, _ in m.patches]
        real = [getattr_static(t, attr) for t, attr in spots]  # static: a classmethod binds anew at every getattr
        with m.planted():
            assert all(getattr_static(t, attr) is not r for (t, attr), r in zip(spots, real, strict=True)), m.id
        assert all(getattr_static(t, attr) is r for (t, attr), r in zip(spots, real, strict=True)), m.id


def test_a_mutant_without_probes_gets_every_probe_part_by_part_whole_cases_last():
    names = [p.id for p in probes_for(Mutant("x", "d", "k"))]
    leaves = [p.id for p in probes() if not p.parts]
    assert sorted(names) == sorted(leaves) and len(set(names)) == len(names)
    assert names[0] == GRID_TP1 and names[-1] == "cases:tp4_dp4_neither"


METADATA_GRID_PARTS = next(p for p in probes() if p.id == "metadata-grid").parts


def test_the_metadata_grid_parts_cover_every_layout():
    assert sorted({lay.tp_size for lay in all_layouts()}) == list(GRID_TP_SIZES)
    assert len(METADATA_GRID_PARTS) == 2 * len(GRID_TP_SIZES)


def _probe(probe_id: str, seen: list, kill: bool) -> Probe:
    def run():
        seen.append(probe_id)
        v = Verdict("P99", checked=1)
        if kill:
            v.fail("throwaway", "field", {"probe": probe_id}, 1, 2)
        return {"P99": v}

    return Probe(probe_id, run)


def test_a_probe_made_of_parts_runs_part_by_part_and_the_killing_part_is_named():
    seen: list[str] = []
    parts = (_probe("p99:a", seen, False), _probe("p99:b", seen, True), _probe("p99:c", seen, True))
    whole = Probe.of("p99", parts)
    prop = Property("P99", "a throwaway property", Needs.SCHEDULES, runs_under="this test", probes=(whole, _probe("p99-other", seen, False)))
    with registry.registered(prop):
        r = run_mutant(Mutant("m", "plants nothing", "test", (), ("p99", "p99-other")))
        assert (r.killed_by, r.killing_probe, r.probes_run, r.probes_not_run) == ("P99", "p99:b", ["p99:a", "p99:b"], ["p99:c", "p99-other"])
        assert seen == ["p99:a", "p99:b"]  # the parts after the kill never ran
        seen.clear()
        full = run_mutant(Mutant("m", "plants nothing", "test", (), ("p99:c", "p99")), all_properties=True)
        assert seen == ["p99:c", "p99:a", "p99:b"]  # a part named on its own runs first, and once
        assert [(p.probe, p.failed) for p in full.probes] == [("p99:c", ["P99"]), ("p99:a", []), ("p99:b", ["P99"])]
        assert all(p.cpu_seconds >= 0 for p in full.probes)
        assert whole.run()["P99"].checked == 3  # run whole (pytest, docs): every part, the verdicts merged


def test_two_different_probes_under_one_id_are_refused():
    seen: list[str] = []
    clash = Probe.of("p99", (_probe("p99:a", seen, False),))
    prop = Property("P99", "a throwaway property", Needs.SCHEDULES, runs_under="this test", probes=(clash, _probe("p99:a", seen, True)))
    with registry.registered(prop), pytest.raises(ValueError, match="two probes share an id: p99:a"):
        probes()


def test_a_child_runs_after_the_parent_used_torch_threads():
    """An OpenMP pool the parent started does not survive a fork: a child using more than one thread would hang."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        (torch.randn(256, 256) @ torch.randn(256, 256)).sum()
        (r,) = run_catalog(["seed-bug"], jobs=1, timeout_s=60.0, catalog=FIXTURES)
    finally:
        torch.set_num_threads(threads)
    assert r.status == "killed", r.error


def test_fixture_catalog_loads():
    assert [m.id for m in load_catalog(FIXTURES)][:2] == ["seed-bug", "no-bug"]
