"""A launched world (tests/test_torchrun.py starts one process per rank) where rank 1 raises
while rank 0 waits for it in a collective: rank 0 must come back at once with the failure,
naming rank 1 and the collective rank 0 was in, and every rank must exit with the same code."""
from __future__ import annotations

import torch

from harness.ranks.joined import join_if_launched
from harness.ranks.outcomes import DistributedRankFailure
from runners.parallel.comm import Group
from runners.parallel.layout import ParallelLayout


def rank1_raises(comm) -> str:
    comm.all_reduce(torch.ones(3), Group.WORLD)
    if comm.rank == 1:
        raise ValueError("planted failure on rank 1")
    comm.all_gather(torch.ones(2, 5), Group.WORLD)  # rank 0 waits here for rank 1
    return "unreachable"


def main() -> None:
    world = join_if_launched("gloo")
    assert world is not None, "start this under torchrun or with the env:// variables"
    if world.rank != 0:
        world.finish(world.serve())
    try:
        world.launch(ParallelLayout(2), rank1_raises, backend="gloo", timeout_s=60)
        print("no failure")
        world.finish(0)
    except DistributedRankFailure as e:
        print(f"{type(e).__name__}: {e}")
        world.finish(1)


if __name__ == "__main__":
    main()
