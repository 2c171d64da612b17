"""A rank process's first act: never outlive the process that launched it.

A spawned rank's parent is the launcher; a rank forked by the forkserver has the server as its parent
(it outlives the launch), so it checks the launcher's pid instead: alive, the lifeline pipe guards from
then on; already gone, the rank exits at once as an orphan."""
from __future__ import annotations

import multiprocessing
import os
import subprocess

import pytest

from harness.ranks import child
from harness.ranks.outcomes import ORPHAN_EXIT_CODE


def _arm_then_exit(launcher_pid: int) -> None:
    child._set_pdeathsig(launcher_pid)
    os._exit(0)


def _exit_code(launcher_pid: int) -> int:
    p = multiprocessing.get_context("fork").Process(target=_arm_then_exit, args=(launcher_pid,))
    p.start()
    p.join(30)
    assert p.exitcode is not None, "the rank process did not exit"
    return p.exitcode


@pytest.fixture
def gone_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: its pid names no process
    return proc.pid


@pytest.fixture
def live_pid():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_a_forked_rank_whose_launcher_is_already_gone_exits_as_an_orphan(gone_pid):
    assert _exit_code(gone_pid) == ORPHAN_EXIT_CODE


def test_a_forked_rank_whose_launcher_lives_goes_on(live_pid):
    assert _exit_code(live_pid) == 0  # its parent is not the launcher (the server's case), the launcher lives


def test_a_spawned_rank_of_a_live_parent_arms_its_death_signal_and_goes_on():
    assert _exit_code(os.getpid()) == 0
