"""SPMD launch of a layout's ranks: simulated (threads in one process) and real (torch.distributed),
spawned by the harness or started by torchrun / srun. `run` is the one entry point for running on them."""
from harness.ranks.kinds import RanksKind

__all__ = ["RanksKind", "run"]


def __getattr__(name: str):
    # `run` (and torch with it) loads on first use: every CLI command reads harness.ranks.launch_env through this
    # package, and the commands that run no rank (--version, explain, list) must start without torch
    if name == "run":
        from harness.ranks.spmd import run
        return run
    raise AttributeError(f"module 'harness.ranks' has no attribute {name!r}")
