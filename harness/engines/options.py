"""What an engine-check run checks: the device paths and the runners, the same options for every engine's adapter.

A path is the code one kind of device runs where an engine has device-specific code (SGLang from
0.5.17: prepare()'s fused Triton fill on GPUs, its native twin on NPUs). A runner is one of the
engine's graph runners (each adapter lists its own). The command line validates both once
(argparse choices); each adapter applies them where it drives the engine (a runner left out is
not built where the others do not need it), and the report names what was left out and why,
so nothing unchecked reads as passed.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Optional


class FillPath(str, Enum):
    """A device's code path, as failures and report lines name it (`path=gpu`, `path=npu`)."""

    GPU = "gpu"
    NPU = "npu"


ALL_PATHS: frozenset[FillPath] = frozenset(FillPath)
PATH_CHOICES = ("all", *(p.value for p in FillPath))


@dataclass(frozen=True)
class Selection:
    """The paths and runners a run checks (runners None: every runner the adapter drives)."""

    paths: frozenset[FillPath] = ALL_PATHS
    runners: Optional[frozenset[str]] = None

    @classmethod
    def from_args(cls, path: str, runners: Optional[Iterable[str]]) -> "Selection":
        return cls(ALL_PATHS if path == "all" else frozenset({FillPath(path)}), None if not runners else frozenset(runners))

    def wants(self, runner: str) -> bool:
        return self.runners is None or runner in self.runners

    def runner_flags(self) -> str:
        return " ".join(f"--runner {r}" for r in sorted(self.runners or ()))

    def left_out(self, known: Iterable[str]) -> list[str]:
        """The runners of `known` this run does not check, each said (for a report's `skipped`)."""
        return [f"{r}: not checked (this run selected {self.runner_flags()})" for r in known if not self.wants(r)]

    def path_flag(self) -> str:
        return "--path " + ("all" if self.paths == ALL_PATHS else ",".join(sorted(p.value for p in self.paths)))


EVERYTHING = Selection()  # every path, every runner: the default run
