"""SPMD launch of a layout's ranks: simulated (threads in one process) and real (torch.distributed),
spawned by the harness or started by torchrun / srun. `run` is the one entry point for running on them."""
from harness.ranks.kinds import RanksKind
from harness.ranks.spmd import run

__all__ = ["RanksKind", "run"]
