"""How a launch of real ranks ends: the outcome classes both launchers raise, and the
helpers a rank uses to send its result or its failure back (by value, picklable).

Shared by the spawning launcher (harness.ranks.launcher) and the joined one, where an
outside launcher such as torchrun started the processes (harness.ranks.joined).
"""
from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any, Optional

from harness.ranks.trace import CollectiveCall, CollectiveError, CollectiveMismatch, CollectiveTimeout

SKIP_EXIT_CODE = 77  # a rank raised RankSkip
FAIL_EXIT_CODE = 1  # a rank raised
ORPHAN_EXIT_CODE = 75  # the parent vanished (lifeline closed)


class RankSkip(Exception):
    """Raised inside a rank's fn: skip this launch (the parent raises LaunchSkipped)."""


class LaunchSkipped(Exception):
    """A rank skipped. Tests translate: ``except LaunchSkipped as e: pytest.skip(e.reason)``."""

    def __init__(self, reason: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.ranks = ranks
        self.exit_codes: dict[int, Optional[int]] = {}  # rank -> exit code (SKIP_EXIT_CODE for the skipped)


class DistributedTimeout(CollectiveTimeout):
    """Not every rank finished in time; the message lists every rank's state."""

    def __init__(self, message: str, states: Optional[dict[int, str]] = None) -> None:
        super().__init__(message)
        self.states = states or {}


class DistributedDeadlock(DistributedTimeout):
    """A rank waits in a collective for a rank that has already returned from fn."""


class DistributedRankFailure(CollectiveError):
    """One or more ranks raised (or died); `failures` maps rank -> traceback (or exit description)."""

    def __init__(self, message: str, failures: dict[int, str], states: Optional[dict[int, str]] = None) -> None:
        super().__init__(message)
        self.failures = failures
        self.states = states or {}


class DistributedMismatch(DistributedRankFailure, CollectiveMismatch):
    """Ranks called different collectives (detected by the signature exchange)."""


@dataclass
class LaunchResult:
    results: list[Any]  # results[rank]: what fn returned on that rank
    traces: list[list[CollectiveCall]]  # traces[rank]: that rank's collective calls
    backend: str
    elapsed_s: float = 0.0
    exit_codes: list[Optional[int]] = field(default_factory=list)


def where_of(hb: Optional[dict]) -> str:
    if not hb or "call" not in hb:
        return ""
    return f"{hb['call']} [collective #{hb.get('seq')}, {hb.get('state')}]"


def exit_text(code: Optional[int]) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def is_pytest_skip(e: BaseException) -> bool:
    return type(e).__name__ == "Skipped" and type(e).__module__.startswith("_pytest")


def error_payload(e: BaseException, tb: str) -> dict[str, Any]:
    return {
        "summary": f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__,
        "message": str(e),
        "traceback": tb,
        "mismatch": isinstance(e, CollectiveMismatch),
    }


def to_cpu(result: Any) -> Any:
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) and x.device.type != "cpu" else x, result)
