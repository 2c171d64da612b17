"""The command line's small traps, each closed: no option abbreviations, did-you-mean for options, cases and mutants,
new-case errors said against the flag (nothing written), --branch, the topk-1 token rule, and under a launcher a
command that would not join the world refused in one line. (Spawned gloo ranks with --mutant: tests/test_real_ranks.py;
torchrun itself: tests/test_torchrun.py.)"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness import mutants
from harness.cases.case import CaseError, load_case
from harness.cli import main, ranks

TOML = """name = "t"
description = "x"

[layout]
tp_size = 2

[spec]
num_steps = 3
topk = {topk}
num_tokens_per_bs = {tokens}

[schedule]
batches = [[2]]
"""


def test_an_abbreviated_option_is_unknown_and_the_closest_is_named(capsys):
    assert main(["check", "--rank", "1", "tp1_neither"]) == 2  # was read as --ranks 1
    err = capsys.readouterr().err
    assert "unrecognized arguments: --rank" in err and "did you mean --ranks?" in err and "harness check --help" in err
    assert main(["golden", "check", "--lim", "3", "tp1_neither"]) == 2  # a nested command: its own options
    assert "did you mean --limit?" in capsys.readouterr().err


def test_a_mistyped_case_name_names_the_closest_cases(capsys):
    assert main(["check", "tp4_atn_tp_gather"]) == 2
    assert "did you mean tp4_attn_tp_gather" in capsys.readouterr().err
    assert main(["replay", "tp1_nether"]) == 2
    assert "did you mean tp1_neither" in capsys.readouterr().err


def test_a_mistyped_mutant_names_the_closest_and_never_dumps_the_catalog(capsys):
    assert main(["check", "tp1_neither", "--mutant", "sglang-2641"]) == 2
    err = capsys.readouterr().err
    assert "unknown mutant 'sglang-2641'; did you mean sglang-26416?" in err and "harness mutants --list" in err
    assert len(err) < 300 and sum(m.id in err for m in mutants.CATALOG) == 1
    assert main(["mutants", "--list"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(mutants.CATALOG)


@pytest.mark.parametrize("flags,says", [
    (["--tp", "3", "--dp", "2"], "--dp 2: tp_size (3) must be divisible by dp_size (2) (case field layout.dp_size; nothing was written)"),
    (["--tp", "1" + "0" * 39, "--dp", "2"], "--tp 1" + "0" * 39 + ": expected an integer in 1..64 (case field layout.tp_size"),
    (["--tp", "2", "--dp-lm-head"], "--dp-lm-head: only meaningful with enable_dp_attention (--dp > 1)"),
    (["--tp", "2", "--steps", "0"], "--steps 0: expected an integer in 1..16"),
    (["--tp", "2", "--batches", "9"], "--batches 9: expected at most spec.max_running_requests (8)"),
    (["--tp", "2", "--tokens-per-bs", "6"], "--tokens-per-bs 6: expected num_steps + 1 (4) with topk 1"),
])
def test_new_case_errors_name_the_flag_and_write_nothing(flags, says, tmp_path, capsys):
    assert main(["new-case", "bad", "--dir", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert says in err, err
    assert err.count("\n") == 1 and "ParallelLayout(" not in err and str(tmp_path) not in err  # no repr, no file blamed
    assert list(tmp_path.iterdir()) == []


def test_new_case_says_which_branch_the_flags_give_and_branch_requires_it(tmp_path, capsys):
    assert main(["new-case", "a", "--tp", "2", "--dir", str(tmp_path)]) == 0
    assert "  branch   neither  (from the flags; --branch BRANCH requires one)" in capsys.readouterr().out
    assert main(["new-case", "b", "--tp", "2", "--branch", "mlp_tp_gather", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    # DP attention with dense TP over every rank is the MLP-TP gather (hand-derived from get_forward_batch's first test)
    assert "--branch mlp_tp_gather: the flags (--tp 2) give neither; e.g. harness new-case b --tp 2 --dp 2" in err
    assert not (tmp_path / "b.toml").exists()
    assert main(["new-case", "b", "--tp", "2", "--dp", "2", "--branch", "mlp_tp_gather", "--dir", str(tmp_path)]) == 0
    assert "  branch   mlp_tp_gather  (as --branch asked)" in capsys.readouterr().out
    assert load_case(tmp_path / "b.toml").layout.branch.value == "mlp_tp_gather"
    assert main(["new-case", "c", "--tp", "4", "--dp", "2", "--branch", "attn_tp_gather", "--dir", str(tmp_path)]) == 2
    assert "give mlp_tp_gather; e.g. harness new-case c --tp 4 --dense-tp 1" in capsys.readouterr().err


def test_topk_1_with_another_token_count_is_refused_as_the_engines_reset_it(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(TOML.format(topk=1, tokens=6))
    with pytest.raises(CaseError, match=r"spec\.num_tokens_per_bs: expected num_steps \+ 1 \(4\) with topk 1.*got 6"):
        load_case(path)
    for topk, tokens in ((1, 4), (2, 6)):  # the chain of 3 drafts and the root; a wider tree with topk 2
        path.write_text(TOML.format(topk=topk, tokens=tokens))
        assert load_case(path).scenario.spec.num_tokens_per_bs == tokens


def test_under_a_launcher_a_command_that_would_not_join_is_refused_in_one_line(monkeypatch, capsys):
    """torchrun --nproc-per-node 2 -m harness check CASE without --ranks gloo ran the case in each process, reporting
    twice. (The real launch: tests/test_torchrun.py.)"""
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    slept: list[float] = []
    monkeypatch.setattr(ranks, "time", SimpleNamespace(sleep=slept.append))
    assert main(["check", "tp1_neither"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "WORLD_SIZE=2" in err and "pass --ranks gloo (CPU) or --ranks nccl" in err
    assert main(["list"]) == 2
    assert "this command runs in one process: run it without the launcher" in capsys.readouterr().err
    assert slept == []  # rank 0 refuses at once
    monkeypatch.setenv("RANK", "1")
    assert main(["check", "tp1_neither"]) == 2  # every process exits 2; only rank 0 says why
    assert capsys.readouterr().err == ""
    assert slept == [ranks.FOLLOWER_GRACE_S]  # after waiting, so that torchrun does not stop rank 0 before it has said why
    assert main(["check", "--bogus", "tp1_neither"]) == 2  # a usage error before any world is joined: the same
    assert capsys.readouterr().err == "" and slept == [ranks.FOLLOWER_GRACE_S] * 2
    assert main(["--version"]) == 0 and slept == [ranks.FOLLOWER_GRACE_S] * 2  # nothing failed: no wait
