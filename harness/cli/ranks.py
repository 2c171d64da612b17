"""How a command meets its ranks: simulated, spawned by us, or launched by torchrun / srun.

Under an outside launcher (harness.ranks.launch_env) every process runs the same command
line; with --ranks gloo|nccl rank 0 runs the command and reports, the others serve its jobs
quietly (harness.ranks.joined), and all of them exit with rank 0's code. Any other command
under a launcher of more than one process is refused in one line (exit 2): each process
would run it alone and print its own report. A --mutant is planted in every process that
runs the case: the launched ranks, and the rank processes we spawn (harness.ranks.launcher
passes the planted ids in their environment).
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Optional

from harness.errors import UsageError
from harness.ranks.launch_env import is_follower, launcher_env

# torchrun stops every process of a launch once one of them exits with an error. A rank other than 0 that fails before
# it joined a world (a refused launch, a usage error: every rank fails alike and only rank 0 says why) and left at once
# could have rank 0 stopped before it printed why (under load rank 0 may be seconds behind): it waits this long first.
FOLLOWER_GRACE_S = 2.0

# The catalog (harness.mutants) and the joined world (harness.ranks.joined) import torch and the runners: imported when
# a command needs them, so a command that needs neither starts without them (harness.cli).


def mutant_ctx(mutant_id: Optional[str]):
    if not mutant_id:
        return contextlib.nullcontext()
    from harness.mutants import get

    return get(mutant_id).planted()


def refuse_unjoined_launch(command: str, ranks: str) -> None:
    """A launcher started this process as one of several, and the command would not join them: refuse."""
    env = launcher_env()
    if env is None or env.world_size < 2 or ranks in ("gloo", "nccl"):
        return
    if command in ("check", "replay"):
        raise UsageError(f"harness {command}: {env.describe()}, and --ranks {ranks} would run the case once in every process: "
                         "pass --ranks gloo (CPU) or --ranks nccl to run it on the launched processes, or run it without the launcher")
    raise UsageError(f"harness {command}: {env.describe()}; this command runs in one process: run it without the launcher "
                     "(only check and replay with --ranks gloo|nccl join a launched world)")


def _joined_world(ranks: str):
    """The launched world this process is in: only real ranks join one, and a process that never imported
    harness.ranks.joined has joined none."""
    if ranks not in ("gloo", "nccl") and "harness.ranks.joined" not in sys.modules:
        return None
    from harness.ranks.joined import join_if_launched

    return join_if_launched(ranks)


def run_command(args) -> int:
    ranks = getattr(args, "ranks", "sim")
    refuse_unjoined_launch(args.command, ranks)
    world = _joined_world(ranks)
    if world is not None and world.rank != 0:
        with mutant_ctx(getattr(args, "mutant", None)):
            return world.serve()
    return args.func(args)


def finish(rc: int) -> int:
    """Launched ranks all leave with rank 0's code (and never return); otherwise rc, a failed follower after
    FOLLOWER_GRACE_S."""
    joined = sys.modules.get("harness.ranks.joined")  # a process that never imported it joined no world
    world = joined.current_world() if joined is not None else None
    if world is not None:
        world.finish(rc)
    if rc != 0 and quiet():
        time.sleep(FOLLOWER_GRACE_S)
    return rc


def quiet() -> bool:
    """This process is a launched rank other than 0: rank 0 reports for it."""
    return is_follower()
