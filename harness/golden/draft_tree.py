"""Draft-tree goldens (P6): <golden-dir>/acceptance/<case>.draft_tree.json, the single-layer draft decode's trees.

What the step body computes, which eager and graph share (P3 cannot see a bug in it), finer than the
accept lengths it decides: the aligned draft leans on the token embedding, so a wrong position or
parent hidden state moves the probabilities long before it moves an accept length. Tree structure is
exact; probabilities within TREE_FLOATS.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from harness.cases.case import Case, default_cases, load_case
from harness.golden.acceptance import ACCEPT_DIR, AcceptanceGoldenError, needs_acceptance, read_golden_json
from harness.golden.base import GoldenKind
from harness.golden.lifecycle import refuse_under_xdist
from harness.golden.place import accept_dir_of, check_writable, record_command
from harness.golden.store import write_text_atomic
from harness.props.p3 import check_loop_replayed
from harness.props.p6_acceptance import P6
from harness.props.tolerances import Tol
from harness.run.loop import SpecSession, case_session
from harness.verdict import Verdict


def needs_draft_tree(case: Case) -> bool:
    """A case whose draft runs the draft decode (single-layer, EAGLE3) and that the loop can run has a draft-tree golden."""
    return case.scenario.spec.draft.has_draft_decode and needs_acceptance(case)


TREE_CASES = tuple(c.name for c in default_cases() if needs_draft_tree(c))  # the shipped single-layer cases
TREE_FORMAT = "specharness-draft-tree/1"
TREE_FLOATS = Tol(1e-5, 1e-5, "fp32 CPU re-run of the recorded workload; a wrong position or parent moves probabilities by far more")
TREE_FIELDS = ("tokens", "parents", "child_index", "scores", "child_p")


def tree_golden_path(name: str, accept_dir: Optional[Path] = None) -> Path:
    return (accept_dir or ACCEPT_DIR) / f"{name}.draft_tree.json"


def tree_arrays(session: SpecSession) -> dict[str, list]:
    """Per loop step and rank, the draft decode's tree of the real requests."""
    out = {}
    for step, reps in enumerate(session.reports):
        for rank, rep in enumerate(reps):
            if rep.decode_outs is not None:
                t = rep.decode_outs.tensors()
                for f in TREE_FIELDS:
                    out[f"s{step}.r{rank}.{f}"] = t[f].tolist()
    return out


def compare_trees(v: Verdict, label: str, want: dict[str, list], got: dict[str, list]) -> None:
    v.expect_equal("draft tree", "keys", {"case": label}, sorted(want), sorted(got), "loop steps and ranks that ran a draft decode")
    for key in sorted(set(want) & set(got)):
        v.checked += 1
        a, b = torch.tensor(want[key]), torch.tensor(got[key])
        exact = not key.endswith(("scores", "child_p"))
        same = a.shape == b.shape and (torch.equal(a, b) if exact else torch.allclose(a, b, rtol=TREE_FLOATS.rtol, atol=TREE_FLOATS.atol))
        if not same:
            v.fail("draft tree", key, {"case": label}, want[key] if exact else "match", got[key] if exact else "differs",
                   "exact" if exact else f"rtol={TREE_FLOATS.rtol} atol={TREE_FLOATS.atol}: {TREE_FLOATS.reason}")


def record_tree_golden(case: Case, accept_dir: Optional[Path] = None) -> Path:
    """From the eager run, into accept_dir (default: beside the case); refused when the graph run's tree differs
    (P3 would say where)."""
    accept_dir = Path(accept_dir) if accept_dir is not None else accept_dir_of(case)
    check_writable(accept_dir)
    refuse_under_xdist(accept_dir)
    sessions = {r: case_session(case, r) for r in ("eager", "graph")}
    v = Verdict(P6)
    data = {"format": TREE_FORMAT, "case": case.name, "fingerprint": case.scenario.model.fingerprint(), "trees": tree_arrays(sessions["eager"])}
    compare_trees(v, case.name, data["trees"], tree_arrays(sessions["graph"]))
    if not v.ok:
        raise AcceptanceGoldenError(f"{case.name}: eager and graph draft trees differ; not recording ({v.first()})")
    path = tree_golden_path(case.name, accept_dir)
    write_text_atomic(path, json.dumps(data, separators=(",", ":")) + "\n")
    return path


def record_tree_goldens(names: Sequence[str] = TREE_CASES, say: Callable[[str], None] = print, accept_dir: Optional[Path] = None,
                        cases_dir: Optional[Path] = None) -> list[Path]:
    """record_tree_golden for each named case (looked up in cases_dir, default the shipped cases)."""
    paths = []
    for name in names:
        paths.append(record_tree_golden(load_case(name, cases_dir), accept_dir))
        say(f"{name}: -> {paths[-1]}")
    return paths


def check_tree_golden(v: Verdict, case: Case, sessions: dict[str, SpecSession], accept_dir: Optional[Path] = None) -> None:
    """Each session's trees against the case's golden (in accept_dir; default: beside the case), into v (a missing or
    foreign golden is a failure)."""
    path = tree_golden_path(case.name, accept_dir or accept_dir_of(case))
    if not path.exists():
        v.fail("draft tree", "file", {"case": case.name}, "a draft-tree golden", "none",
               f"record it: {record_command(case, None if accept_dir is None else Path(accept_dir).parent, GoldenKind.DRAFT_TREE)}")
        return
    try:
        data = read_golden_json(path, TREE_FORMAT)
    except AcceptanceGoldenError as e:
        v.fail("draft tree", "file", {"case": case.name}, TREE_FORMAT, "unreadable", f"{e}; re-record it")
        return
    if data.get("fingerprint") != case.scenario.model.fingerprint():
        v.fail("draft tree", "fingerprint", {"case": case.name}, case.scenario.model.fingerprint(), data.get("fingerprint"),
               "recorded for another model; re-record it")
        return
    for runner, s in sessions.items():
        compare_trees(v, f"{case.name} ({runner})", data["trees"], tree_arrays(s))


def check_tree_case(case: Case) -> Verdict:
    """The draft-tree golden alone, eager and graph (`harness golden check --kind draft-tree`)."""
    v = Verdict(P6)
    sessions = {r: case_session(case, r) for r in ("eager", "graph")}
    check_loop_replayed(v, sessions["graph"], {"case": case.name, "runner": "graph"})
    check_tree_golden(v, case, sessions)
    return v
