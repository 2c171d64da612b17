"""`harness golden record|check --kind acceptance|draft-tree`: the loop goldens go through the golden lifecycle.

Recording writes the shipped file again (the format did not change: the same bytes apart from the
float literals, which are the same within the golden's own tolerance, since an fp32 CPU re-run on
another SIMD width rounds differently), atomically, and leaves an unchanged golden alone; check fails on a planted mutant and names the golden kind.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from harness.cases.case import CaseError, load_case
from harness.cli import main
from harness.golden import GOLDEN_DIR, draft_tree
from harness.golden import store as golden_store
from harness.verdict import Verdict
from runners.attention.kinds import AttentionBackend

ACCEPT = GOLDEN_DIR / "acceptance"
FLOAT = re.compile(rb"-?\d+\.\d+(?:[eE][-+]?\d+)?|-?\d+[eE][-+]?\d+")


@pytest.fixture
def serial(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # a private golden dir cannot race; the shipped one is never written here


@pytest.mark.parametrize(("kind", "case", "file"), [("acceptance", "tp1_neither", "tp1_neither.json"),
                                                    ("draft-tree", "tp2_single_layer_shrink", "tp2_single_layer_shrink.draft_tree.json")])
def test_record_rewrites_the_shipped_bytes(tmp_path, serial, capsys, kind, case, file):
    assert main(["golden", "record", "--kind", kind, case, "--golden-dir", str(tmp_path)]) == 0
    got, want = (tmp_path / "acceptance" / file).read_bytes(), (ACCEPT / file).read_bytes()
    assert FLOAT.sub(b"F", got) == FLOAT.sub(b"F", want)  # keys, order, separators, every integer: byte for byte
    floats = [torch.tensor([float(m) for m in FLOAT.findall(b)], dtype=torch.float64) for b in (got, want)]
    tol = draft_tree.TREE_FLOATS  # the draft-tree golden's own bound (the acceptance golden's floats are exact means of integers)
    torch.testing.assert_close(floats[0], floats[1], rtol=tol.rtol, atol=tol.atol)
    assert [p.name for p in (tmp_path / "acceptance").iterdir() if p.name.endswith(".tmp")] == []


def test_an_unchanged_acceptance_golden_is_not_rewritten(tmp_path, serial, capsys):
    (tmp_path / "acceptance").mkdir()
    path = tmp_path / "acceptance" / "tp1_neither.json"
    path.write_bytes((ACCEPT / "tp1_neither.json").read_bytes())
    os.utime(path, (1, 1))
    assert main(["golden", "record", "--kind", "acceptance", "tp1_neither", "--golden-dir", str(tmp_path)]) == 0
    assert "unchanged" in capsys.readouterr().out
    assert path.stat().st_mtime == 1


def test_a_failed_write_leaves_the_old_golden(tmp_path, monkeypatch):
    path = tmp_path / "g.json"
    path.write_text("old\n")

    def crash(*_a):
        raise OSError("disk gone")

    monkeypatch.setattr(golden_store.os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        golden_store.write_text_atomic(path, "new\n")
    assert path.read_text() == "old\n"


def test_check_acceptance_passes_and_fails_under_a_mutant(capsys):
    assert main(["golden", "check", "--kind", "acceptance", "tp1_neither"]) == 0
    assert "PASS tp1_neither" in capsys.readouterr().out
    assert main(["golden", "check", "--kind", "acceptance", "tp1_neither", "--mutant", "draft-hidden-next-step"]) == 1
    out = capsys.readouterr().out
    assert "FAIL tp1_neither" in out and "golden" in out


def test_record_without_cases_names_the_kind(serial, capsys):
    assert main(["golden", "record", "--kind", "draft-tree"]) == 2
    assert "--kind draft-tree tp1_eagle3" in capsys.readouterr().err  # the first shipped case with a draft decode


def test_an_unknown_kind_names_the_allowed_ones(capsys):
    assert main(["golden", "check", "--kind", "trees"]) == 2
    assert "--kind: expected one of arrays, acceptance, draft-tree, logprobs, got 'trees'" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "said"), [
    (["check", "tp1_neither", "--ranks", "threads"], "--ranks: expected one of sim, gloo, nccl, got 'threads'"),
    (["replay", "tp1_neither", "--runner", "cuda"], "--runner: expected one of eager, graph, both, got 'cuda'"),
])
def test_an_option_outside_its_enum_is_refused_once_with_the_allowed_values(capsys, argv, said):
    assert main(argv) == 2
    assert said in capsys.readouterr().err


def test_a_case_file_backend_is_parsed_into_the_enum(tmp_path):
    assert load_case("tp1_neither").scenario.attention_backend is AttentionBackend.TORCH
    text = Path(load_case("tp1_neither").path).read_text().replace('backend = "torch"', 'backend = "cuda"')
    (tmp_path / "tp1_neither.toml").write_text(text)
    with pytest.raises(CaseError, match=r"tp1_neither.toml.*backend.*one of torch, triton, flashinfer"):
        load_case(str(tmp_path / "tp1_neither.toml"))


@pytest.mark.parametrize("text,field", [("{not json", "file"), ('{"format": "specharness-acceptance/1"}', "file"),
                                        ('{"format": "specharness-draft-tree/1", "fingerprint": "other", "trees": {}}', "fingerprint")])
def test_a_malformed_or_foreign_draft_tree_golden_is_a_failed_verdict_naming_the_file(tmp_path, text, field):
    case = load_case("tp2_single_layer_shrink")
    path = draft_tree.tree_golden_path(case.name, tmp_path)
    path.write_text(text)
    v = Verdict("P6")
    draft_tree.check_tree_golden(v, case, {}, accept_dir=tmp_path)  # no session needed: the file is refused first
    assert not v.ok and v.failures[0].field == field, v.report()
    if field == "file":
        assert str(path) in v.failures[0].message(), v.report()
