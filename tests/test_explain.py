"""`harness explain ID`: every property and invariant a failure can name has its text, printed from the reference
file that ships in the package (harness/props/reference.md, the page the docs site includes)."""
import json
import re
from pathlib import Path

import pytest

from harness.cli import main

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO / "harness" / "props" / "reference.md"
PROPERTIES = [f"P{i}" for i in range(1, 9)]
INVARIANTS = [f"I{i}" for i in range(1, 8)]


def _raw_section(anchor: str) -> str:
    """The body under the heading with {#anchor}, cut at the next heading: read here with a regex of its own, not
    through harness.cli.explain, so the command is compared with the file and not with itself."""
    m = re.search(r"^#{2,3} [^\n]*\{#" + anchor + r"\}\n(.*?)(?=^#|\Z)", REFERENCE.read_text(), re.S | re.M)
    assert m, f"no section {{#{anchor}}} in {REFERENCE}"
    return m.group(1).strip()


@pytest.mark.parametrize("sid", PROPERTIES + INVARIANTS)
def test_every_property_and_invariant_has_the_three_parts(sid):
    body = _raw_section(sid.lower())
    for part in ("**Asserts.**", "**Why the engine needs it.**", "**A bug it catches.**"):
        assert part in body, f"{sid}: no {part}"
    assert "DESIGN" not in body  # the product's own words, never a file it does not ship


@pytest.mark.parametrize("sid", ["I3", "P2", "p2", "padding"])
def test_explain_prints_the_section_from_the_reference_file(capsys, sid):
    assert main(["explain", sid]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(sid.upper() if sid != "padding" else "Padding")
    assert _raw_section(sid.lower()).replace("**", "") in out


def test_explain_i3_is_i3_and_nothing_else(capsys):
    assert main(["explain", "I3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("I3 — MLP-TP and attn-TP branches agree\n")
    assert "the gathered buffer holds every row" not in out  # I4's title: the section stops at the next heading


def test_explain_p1_names_its_invariants_without_printing_them(capsys):
    assert main(["explain", "P1"]) == 0
    out = capsys.readouterr().out
    assert "Checks inside it: I1, I2, I3, I4, I5, I6, I7, padding" in out
    assert "capture equals replay fill" not in out


def test_explain_without_an_id_lists_every_one(capsys):
    assert main(["explain"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line and not line.startswith("harness")]
    assert set(PROPERTIES + INVARIANTS) <= set(listed)
    assert main(["explain", "--json"]) == 0
    assert {d["id"] for d in json.loads(capsys.readouterr().out)} >= set(PROPERTIES + INVARIANTS)


def test_unknown_id_is_a_usage_error_with_a_did_you_mean(capsys):
    assert main(["explain", "I9"]) == 2
    err = capsys.readouterr().err
    assert "unknown id 'I9'" in err and "did you mean" in err and "I1" in err
    assert main(["explain", "nothing-like-it"]) == 2
    err = capsys.readouterr().err
    assert "did you mean" not in err and "known: P1" in err


def test_every_invariant_a_check_can_fail_on_is_explained():
    """A failure prints `P1/I<n> ...`: every I<n> the checks use (harness/ and its engine adapters) has a section."""
    used = set()
    for path in (REPO / "harness").rglob("*.py"):
        used |= set(re.findall(r"""["'](I\d+)["']""", path.read_text()))
    assert used, "found no invariant ids in harness/: the pattern above no longer matches how checks name them"
    assert used <= set(INVARIANTS), sorted(used - set(INVARIANTS))
    for sid in used:
        _raw_section(sid.lower())
