"""Was this process started as one rank of a world by an outside launcher, and which rank?

Distributed engines are run by torchrun (or srun on SLURM): one process per rank, across
nodes, meeting through env:// (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
Under such a launcher `--ranks gloo|nccl` must join that world instead of spawning its own
ranks (harness.ranks.joined).

* torchrun, or any launcher that sets the env:// variables: RANK, WORLD_SIZE, MASTER_ADDR
  and MASTER_PORT all set (LOCAL_RANK defaults to 0). All four are required, so the spawning
  launcher's own children (RANK and WORLD_SIZE, no MASTER_*) never mistake themselves for one.
* SLURM, when the torchrun variables are absent: SLURM_PROCID -> RANK, SLURM_NTASKS ->
  WORLD_SIZE, SLURM_LOCALID -> LOCAL_RANK, and only for a step of more than one task (a
  shell inside an allocation, or `srun -n 1`, keeps spawning its own ranks). SLURM does not
  say where rank 0 listens: MASTER_ADDR and MASTER_PORT must be exported by the job script.
* SPECHARNESS_LAUNCHER=spawn: never a launched rank (a batch script of a many-task job sets
  SLURM_PROCID and SLURM_NTASKS in its own process too; there the harness should spawn).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from harness.errors import UsageError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS")
OPT_OUT_ENV = "SPECHARNESS_LAUNCHER"  # "spawn": ignore any launcher's variables


@dataclass(frozen=True)
class LauncherEnv:
    source: str  # "torchrun" (TORCHELASTIC_RUN_ID set) | "env://" (the variables alone) | "slurm"
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    run_id: str = ""  # torchrun's run id and restart count: keys of an earlier attempt never collide

    def env_vars(self) -> dict[str, str]:
        """The env:// variables for this rank (what torch's env:// rendezvous reads)."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }

    def describe(self) -> str:
        return f"{self.source} started {self.world_size} process(es) (WORLD_SIZE={self.world_size})"


def _int(environ: Mapping[str, str], name: str, default: Optional[int] = None) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise UsageError(f"launcher environment: {name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"launcher environment: {name}={raw!r} is not an integer") from None


def launcher_env(environ: Optional[Mapping[str, str]] = None) -> Optional[LauncherEnv]:
    """The outside launcher's view of this process, or None when nothing launched it as a rank."""
    env = os.environ if environ is None else environ
    if env.get(OPT_OUT_ENV, "") == "spawn":
        return None
    if all(env.get(v) for v in TORCHRUN_VARS):
        source = "torchrun" if env.get("TORCHELASTIC_RUN_ID") else "env://"
        rank, ws, local = _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK", 0)
        run_id = f"{env.get('TORCHELASTIC_RUN_ID', '')}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    elif all(env.get(v) for v in SLURM_VARS) and _int(env, "SLURM_NTASKS") > 1:
        source = "slurm"
        rank, ws, local = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"), _int(env, "SLURM_LOCALID", 0)
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not env.get(v)]
        if missing:
            raise UsageError(f"srun started {ws} tasks but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: "
                             "export MASTER_ADDR (the first node's host name) and MASTER_PORT (a free port) in the job script, "
                             f"or set {OPT_OUT_ENV}=spawn to spawn the ranks from this one process")
        run_id = f"slurm.{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}"
    else:
        return None
    if ws < 1 or not 0 <= rank < ws:
        raise UsageError(f"{source} launcher environment: rank {rank} is not in 0..{ws - 1} (world size {ws})")
    port = _int(env, "MASTER_PORT")
    if not 0 < port < 65536:
        raise UsageError(f"{source} launcher environment: MASTER_PORT={port} is not a port")
    return LauncherEnv(source, rank, ws, local, env["MASTER_ADDR"], port, run_id)


def is_follower() -> bool:
    """A rank other than 0 of an outside launch: it stays quiet (rank 0 reports for everyone)."""
    try:
        env = launcher_env()
    except UsageError:
        return False
    return env is not None and env.rank != 0
