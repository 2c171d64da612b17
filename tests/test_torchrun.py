"""`harness check --ranks gloo` in processes an outside launcher started: torchrun, or anything
that sets the env:// variables (srun's SLURM_* included).

Two runs go through torchrun itself (2 and 4 ranks, green: one report, exit 0). The others
start the processes the way torchrun and srun do, by environment alone, so that each
process's exit code and output can be read: every rank must exit with the same code, and
only rank 0 may print.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from harness.cases.template import new_case
from harness.errors import UsageError
from harness.ranks.joined_report import Outcome, launch_error
from harness.ranks.launch_env import LauncherEnv, launcher_env
from harness.ranks.outcomes import DistributedDeadlock, DistributedMismatch, DistributedRankFailure, DistributedTimeout
from runners.parallel.layout import ParallelLayout
from tests.helpers.prewarmed import Started, start_module, start_script

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parent.parent
LIMIT_S = 240  # a hung launch fails the test instead of hanging the suite


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def _torchrun(nproc: int, *args: str, module: str = "harness.cli") -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node N -m harness.cli ARGS` (or another module that runs it). The ranks are what is under test: torchrun starts each as a
    fresh `python -m harness.cli` with its variables, as on a user's node. torchrun's own agent (which imports torch
    before it starts them) is forked from the prewarmed server, its environment the caller's: the Triton setting the
    server's children carry is dropped unless the caller has it, so the ranks see exactly the launcher's environment."""
    env = _base_env()
    argv = ["--nproc-per-node", str(nproc), "--master-port", str(_free_port()), "-m", module, *args]
    code = ("import os, runpy, sys\n" + ("" if "TRITON_INTERPRET" in env else "del os.environ['TRITON_INTERPRET']\n") +
            f"sys.argv = ['torchrun', *{argv!r}]\nrunpy.run_module('torch.distributed.run', run_name='__main__', alter_sys=True)\n")
    return Started(code, ROOT, env).result(timeout=LIMIT_S)


def _launch_by_env(nproc: int, args: list[str], slurm: bool = False, extra_env: dict[str, str] | None = None,
                   script: Path | None = None) -> list[tuple[int, str, str]]:
    """nproc `python -m harness.cli ARGS` (or `python SCRIPT`) started as a launcher would, each a process of its own
    forked from the prewarmed server (torch imported once): (exit code, stdout, stderr) per rank. What is under test is
    the CLI's reading of the launcher's environment and its ranks' exits, not the interpreter's start."""
    port = str(_free_port())
    procs = []
    for r in range(nproc):
        env = _base_env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} | (extra_env or {})
        if slurm:
            env |= {"SLURM_PROCID": str(r), "SLURM_NTASKS": str(nproc), "SLURM_LOCALID": str(r), "SLURM_JOB_ID": "7"}
        else:
            env |= {"RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(r)}
        procs.append(start_script(script, env=env) if script else start_module("harness.cli", *args, env=env))
    deadline = time.monotonic() + LIMIT_S
    out = []
    for p in procs:  # a rank still running at the deadline is killed by result(), which raises TimeoutExpired
        done = p.result(timeout=max(1.0, deadline - time.monotonic()))
        out.append((done.returncode, done.stdout, done.stderr))
    return out


# ---- through torchrun ----------------------------------------------------------------------


def test_torchrun_2_ranks_green_one_json_report():
    res = _torchrun(2, "check", "--ranks", "gloo", "--json", "tp2_neither")
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout)  # one document: rank 1 printed nothing
    assert report["ok"] is True
    assert [c["case"] for c in report["cases"]] == ["tp2_neither"]
    assert set(report["cases"][0]["properties"]) == {"P1", "P3", "P4"}


def test_torchrun_4_ranks_green_report_once():
    res = _torchrun(4, "check", "--ranks", "gloo", "tp4_dp4_neither")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("PASS tp4_dp4_neither") == 1
    assert res.stdout.count("1 passed, 0 failed") == 1


def test_torchrun_without_real_ranks_is_refused_once_and_runs_nothing():
    """Without --ranks gloo every process would run the case alone and print its own report. Rank 0, the one that says
    why, starts a second behind: torchrun stops it when rank 1 exits unless rank 1 waits (harness.cli.ranks)."""
    res = _torchrun(2, "check", "tp2_neither", module="tests.helpers.rank0_behind")
    assert res.returncode != 0 and "PASS" not in res.stdout and "passed" not in res.stdout, res.stdout[-2000:]
    assert res.stderr.count("--ranks sim would run the case once in every process") == 1, res.stderr[-3000:]


# ---- started by environment alone: every rank's exit code --------------------------------------


def test_world_size_mismatch_is_a_usage_error_on_every_rank_slurm():
    ranks = _launch_by_env(2, ["check", "--ranks", "gloo", "tp4_dp4_neither"], slurm=True)
    assert [code for code, _, _ in ranks] == [2, 2]
    _, out0, err0 = ranks[0]
    assert "needs world size 4" in err0 and "WORLD_SIZE=2" in err0 and "slurm" in err0
    assert "Traceback" not in err0
    assert ranks[1][1:] == ("", "")  # rank 1 is quiet: rank 0 reports for it


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_nccl_without_a_gpu_is_a_usage_error():
    (code, out, err), = _launch_by_env(1, ["check", "--ranks", "nccl", "tp1_neither"])
    assert code == 2 and "--ranks: rank 0: backend nccl needs a GPU per rank: LOCAL_RANK=0, and this node has 0" in err, err


def test_planted_desync_fails_every_rank_naming_rank_and_collective():
    ranks = _launch_by_env(2, ["check", "--ranks", "gloo", "--mutant", "idle-rank-skips-mlp-sync", "tp2_dp2_mlp_tp_gather"])
    assert [code for code, _, _ in ranks] == [1, 1]
    out0 = ranks[0][1]
    assert "FAIL tp2_dp2_mlp_tp_gather" in out0 and "run:FAIL" in out0
    assert "collective mismatch in group attn_dp" in out0
    assert "rank 1 called all_gather(group=attn_dp" in out0 and "rank 0 called all_gather(group=attn_dp" in out0
    assert ranks[1][1] == ""


def test_rank_returning_early_is_a_deadlock_not_a_hang(tmp_path):
    """Without the signature exchange (as on NCCL) the idle rank's skip is a true hang: the busy
    rank waits in the MLP sync for a rank that returned from fn. It must come back as a
    deadlock naming both, long before the process group's 60 s timeout."""
    layout = ParallelLayout(2, 2, True, moe_dense_tp_size=1, enable_dp_lm_head=True, moe_a2a_backend="deepep")
    path, _ = new_case("tp2_dp2_neither_idle", layout, batches=[[2, 0]], directory=tmp_path)
    ranks = _launch_by_env(2, ["check", "--ranks", "gloo", "--mutant", "idle-rank-skips-mlp-sync", "--props", "P3", str(path)],
                           extra_env={"SPECHARNESS_CHECK_COLLECTIVES": "0"})
    assert [code for code, _, _ in ranks] == [1, 1]
    out0 = ranks[0][1]
    assert "deadlock after" in out0
    assert "rank 0 waits in all_gather(group=attn_dp" in out0 and "for rank(s) 1, which returned from fn" in out0


def test_rank_failure_names_the_rank_and_the_collective_its_peer_waits_in():
    """Rank 1 raises while rank 0 waits for it in an all_gather: rank 1 leaves its process group,
    so rank 0's collective fails at once instead of at the 60 s timeout, and the report leads
    with rank 1's exception, rank 0's collective named as a consequence."""
    ranks = _launch_by_env(2, [], script=ROOT / "tests" / "helpers" / "joined_rank_fails.py")
    assert [code for code, _, _ in ranks] == [1, 1], ranks
    out0 = ranks[0][1]
    assert out0.startswith("DistributedRankFailure: rank 1 failed in all_reduce(group=world, shape=(3,), dtype=float32) "
                           "[collective #0, left]: ValueError: planted failure on rank 1"), out0
    assert "rank 0: lost its peer while in all_gather(group=world, shape=(2, 5), dtype=float32) [collective #1, entered]" in out0
    assert "in rank1_raises" in out0  # rank 1's traceback came along
    assert ranks[1][1] == ""


# ---- the launcher's environment ----------------------------------------------------------------


def test_launcher_env_torchrun_and_slurm():
    assert launcher_env({}) is None
    assert launcher_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) is None  # our own spawned children
    tr = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
          "TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert launcher_env(tr) == LauncherEnv("torchrun", 3, 4, 1, "node0", 29500, "abc.2")
    plain = {k: v for k, v in tr.items() if not k.startswith("TORCHELASTIC")}
    assert launcher_env(plain).source == "env://"
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "29400"}
    env = launcher_env(slurm)
    assert (env.source, env.rank, env.world_size, env.local_rank) == ("slurm", 5, 8, 1)
    assert env.env_vars() == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "29400"}
    assert launcher_env(slurm | tr).source == "torchrun"  # torchrun's variables win
    assert launcher_env(slurm | {"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None  # one task: spawn our own ranks
    assert launcher_env(tr | {"SPECHARNESS_LAUNCHER": "spawn"}) is None  # the opt-out


@pytest.mark.parametrize("env, words", [
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "MASTER_ADDR and MASTER_PORT are not set"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "n0"}, "MASTER_PORT is not set"),
    ({"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "n0", "MASTER_PORT": "1"}, "rank 4 is not in 0..3"),
    ({"RANK": "x", "WORLD_SIZE": "4", "MASTER_ADDR": "n0", "MASTER_PORT": "1"}, "RANK='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "n0", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a port"),
])
def test_launcher_env_errors_name_the_variable(env, words):
    with pytest.raises(UsageError, match=words):
        launcher_env(env)


# ---- what rank 0 makes of the outcomes -----------------------------------------------------------


def _error(rank: int, message: str, where: str = "", mismatch: bool = False) -> Outcome:
    payload = {"summary": message.splitlines()[0], "message": message, "traceback": f"Traceback ...\n{message}\n", "mismatch": mismatch}
    return Outcome(rank, "error", payload, where=where)


AG = "all_gather(group=attn_tp, shape=(2, 64), dtype=float32) [collective #7, entered]"
LOST = "[pair.cc:553] Connection closed by peer [127.0.0.1]:1234"


def test_root_failure_named_before_its_consequences():
    outcomes = [_error(0, f"RuntimeError: {LOST}", AG), _error(1, "ValueError: boom", AG), Outcome(2, "ok", None), None]
    err = launch_error(outcomes, "4 ranks", 1.0)
    assert type(err) is DistributedRankFailure and list(err.failures) == [1]
    head = str(err).splitlines()[0]
    assert head == f"rank 1 failed in {AG}: ValueError: boom"
    assert err.states[0] == f"lost its peer while in {AG}" and err.states[2] == "finished"
    assert err.states[3].startswith("no outcome")


def test_mismatch_deadlock_and_timeout_outcomes():
    mm = launch_error([_error(0, "collective mismatch in group attn_dp: ...", AG, True), Outcome(1, "ok", None)], "2 ranks", 1.0)
    assert type(mm) is DistributedMismatch and str(mm).startswith("collective mismatch in group attn_dp")
    dl = launch_error([_error(0, f"RuntimeError: {LOST}", AG), Outcome(1, "ok", None)], "2 ranks", 2.5)
    assert type(dl) is DistributedDeadlock
    assert str(dl).startswith(f"deadlock after 2.5 s: rank 0 waits in {AG} for rank(s) 1, which returned from fn")
    to = launch_error([_error(0, "RuntimeError: Timed out waiting 60000ms for recv operation", AG), None], "2 ranks", 61.0)
    assert type(to) is DistributedTimeout and to.states[0] == f"timed out in {AG}"
