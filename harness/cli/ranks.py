"""How a command meets its ranks: simulated, spawned by us, or launched by torchrun / srun.

Under an outside launcher (harness.ranks.launch_env) every process runs the same command
line; rank 0 runs the command and reports, the others serve its jobs quietly
(harness.ranks.joined), and all of them exit with rank 0's code. A --mutant is planted in
every one of those processes, so unlike spawned ranks, launched ranks do run it.
"""
from __future__ import annotations

import contextlib
from typing import Optional

from harness.errors import UsageError
from harness.mutants import get
from harness.ranks.joined import current_world, is_follower, join_if_launched


def mutant_ctx(mutant_id: Optional[str]):
    if not mutant_id:
        return contextlib.nullcontext()

    return get(mutant_id).planted()


def run_command(args) -> int:
    ranks = getattr(args, "ranks", "sim")
    world = join_if_launched(ranks)
    if getattr(args, "mutant", None) and ranks != "sim" and world is None:
        raise UsageError("--mutant is planted in this process only; real ranks would run unmutated: use --ranks sim")
    if world is not None and world.rank != 0:
        with mutant_ctx(getattr(args, "mutant", None)):
            return world.serve()
    return args.func(args)


def finish(rc: int) -> int:
    """Launched ranks all leave with rank 0's code (and never return); otherwise rc."""
    world = current_world()
    if world is not None:
        world.finish(rc)
    return rc


def quiet() -> bool:
    """This process is a launched rank other than 0: rank 0 reports for it."""
    return is_follower()
