"""Goldens are never corrupted: no record with a mutant planted (CLI, new-case --record, the API), nothing written into
the installed package or into a checkout's shipped data from outside it, and a user's goldens beside the user's cases,
where every hint's command then finds them. (The plugin's force-regen: tests/test_plugin.py; the wheel, byte for byte:
tests/test_packaging.py.)"""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from harness import mutants
from harness.cases.case import CASES_DIR, load_case
from harness.cases.data import package_dir
from harness.cli import main
from harness.golden import GOLDEN_DIR, GoldenError, check_golden, record_golden
from harness.golden.acceptance import record_acceptance_golden
from harness.golden.case_goldens import missing_kinds
from harness.golden.draft_tree import record_tree_golden
from harness.golden.place import GoldenWriteRefused, case_golden_dir, check_writable, golden_dir_for, record_command
from harness.golden.store import write_text_atomic

MUTANT = "sglang-26416"
TINY = """name = "{name}"
description = "a tiny case of the user's own"

[layout]
tp_size = 2

[spec]
num_steps = 1
capture_bs = [2]
max_running_requests = 2

[schedule]
batches = [[2], [1]]
"""


def user_case(tmp_path: Path, name: str = "mine") -> Path:
    d = tmp_path / "mycases"
    d.mkdir(exist_ok=True)
    (d / f"{name}.toml").write_text(TINY.format(name=name))
    return d / f"{name}.toml"


def files_under(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file()) if d.exists() else []


# ---------------------------------------------------------------------------------------- a planted mutant


def test_every_record_path_refuses_while_a_mutant_is_planted_naming_it(tmp_path):
    case = load_case(user_case(tmp_path))
    with mutants.get(MUTANT).planted():
        for record in (lambda: record_golden(case, tmp_path / "g"), lambda: record_acceptance_golden(case, tmp_path / "g" / "acceptance"),
                       lambda: record_tree_golden(case, tmp_path / "g" / "acceptance"),
                       lambda: write_text_atomic(tmp_path / "g" / "x.json", "{}")):
            with pytest.raises(GoldenWriteRefused, match=f"while mutant {MUTANT} is planted"):
                record()
    assert files_under(tmp_path / "g") == []
    assert record_golden(case, tmp_path / "g").status == "new"  # the mutant gone: recorded


def test_golden_record_and_new_case_record_exit_2_naming_the_planted_mutant(tmp_path, capsys):
    path = user_case(tmp_path)
    with mutants.get(MUTANT).planted():
        assert main(["golden", "record", "mine", "--cases-dir", str(path.parent)]) == 2
        assert f"mutant {MUTANT} is planted" in capsys.readouterr().err
        assert main(["new-case", "other", "--tp", "2", "--dir", str(path.parent), "--record"]) == 2
        assert f"mutant {MUTANT} is planted" in capsys.readouterr().err
    assert not (path.parent / "other.toml").exists()  # refused before the case file was written
    assert files_under(path.parent / "golden") == []


# ---------------------------------------------------------------------------------------- where goldens live


def test_a_users_goldens_live_beside_the_users_cases_and_the_shipped_ones_stay_put(tmp_path):
    path = user_case(tmp_path)
    assert golden_dir_for(path.parent) == path.parent / "golden"
    assert golden_dir_for(CASES_DIR) == GOLDEN_DIR
    assert case_golden_dir(load_case(path)) == path.parent / "golden"
    assert case_golden_dir(load_case("tp1_neither")) == GOLDEN_DIR


def test_the_missing_golden_hint_is_a_command_that_records_it_where_it_is_read(tmp_path, capsys):
    """The issue: with --cases-dir mycases the hint said `harness golden record my_case`, which then failed."""
    case = load_case(user_case(tmp_path))
    with pytest.raises(GoldenError) as info:
        check_golden(case)
    cmd = record_command(case)
    assert cmd == f"harness golden record mine --cases-dir {shlex.quote(str(tmp_path / 'mycases'))}"
    assert f"record it with `{cmd}`" in str(info.value)
    assert missing_kinds(case) != []
    assert main(shlex.split(cmd)[1:]) == 0  # the hint, as typed
    out = capsys.readouterr().out
    assert "mycases/golden/mine.npz" in out and "mycases/golden/acceptance/mine.json" in out
    assert missing_kinds(case) == []  # every kind its checks read: arrays and acceptance
    assert check_golden(case).ok
    assert main(["check", "mine", "--cases-dir", str(tmp_path / "mycases"), "--props", "P6"]) == 0  # P6 reads it beside the case


def test_golden_record_with_an_explicit_golden_dir_hints_that_flag_too(tmp_path):
    case = load_case(user_case(tmp_path))
    mine = tmp_path / "elsewhere"
    with pytest.raises(GoldenError, match="--golden-dir"):
        check_golden(case, mine)
    assert record_command(case, mine).endswith(f"--golden-dir {shlex.quote(str(mine))}")


# ---------------------------------------------------------------------------------------- never into the package


def test_nothing_is_written_inside_the_package_even_through_the_api(tmp_path):
    inside = package_dir() / "_data" / "golden"
    with pytest.raises(GoldenWriteRefused, match="inside the installed specharness package.*--cases-dir DIR"):
        check_writable(inside)
    with pytest.raises(GoldenWriteRefused):
        write_text_atomic(inside / "acceptance" / "x.json", "{}")
    assert not inside.exists()  # (this checkout's package has no _data: nothing was created)


def test_a_checkouts_shipped_goldens_are_written_from_inside_it_only(tmp_path, monkeypatch, capsys):
    check_writable(GOLDEN_DIR)  # the tests run from the checkout: how the shipped goldens are (re)made
    monkeypatch.chdir(tmp_path)  # a project elsewhere that imports this checkout
    with pytest.raises(GoldenWriteRefused, match="re-recorded from inside it"):
        check_writable(GOLDEN_DIR)
    with pytest.raises(GoldenWriteRefused):
        check_writable(CASES_DIR)
    assert main(["golden", "record", "tp1_neither"]) == 2
    err = capsys.readouterr().err
    assert "refusing to write into" in err and "--cases-dir DIR" in err
    assert main(["new-case", "x", "--tp", "1"]) == 2  # the default --dir is the shipped cases: refused, names --dir
    assert "--dir DIR" in capsys.readouterr().err and not (CASES_DIR / "x.toml").exists()
