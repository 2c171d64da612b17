"""The kinds of ranks a scenario runs on, parsed once where a user names one (CLI flag, case file)."""
from __future__ import annotations

from enum import StrEnum


class RanksKind(StrEnum):
    SIM = "sim"  # threads of one process, a SimulatedWorld: traces and failures, no torch.distributed
    GLOO = "gloo"  # a process per rank over gloo (CPU)
    NCCL = "nccl"  # a process per rank over nccl, a GPU each

    @property
    def device(self) -> str:
        """Where a rank's tensors live: nccl ranks own a GPU, the others run on the CPU."""
        return "cuda" if self is RanksKind.NCCL else "cpu"

    @classmethod
    def parse(cls, value: str, where: str = "ranks") -> "RanksKind":
        """The kind named by `value`, or a ValueError naming `where` and the allowed values."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{where}: expected one of {', '.join(k.value for k in cls)}, got {value!r}") from None
