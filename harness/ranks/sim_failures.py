"""How a simulated launch fails: a collective abandoned for a peer's failure (a consequence),
and the launch's error, which leads with the rank that failed on its own.
"""
from __future__ import annotations

from typing import Optional

from harness.ranks.trace import CollectiveError


class PeerFailed(CollectiveError):
    """A collective abandoned because a peer failed; a consequence, never a root cause."""

    def __init__(self, peer: int, cause: str) -> None:
        super().__init__(f"peer rank {peer} failed: {cause}")
        self.peer = peer


class RankFailure(RuntimeError):
    """One or more ranks raised in fn. The message leads with the root cause.

    failures: rank -> (exception, formatted traceback), for every rank that raised.
    root_rank: the lowest rank whose own code raised; else the lowest whose collective failed on its own (a mismatch,
    a deadlock, a deadline), not with PeerFailed; else the lowest rank. Never the first in time: several ranks that
    hit one bug raise in whatever order their threads ran, and the report names the same rank on every run.
    """

    def __init__(self, failures: dict[int, tuple[BaseException, str]]) -> None:
        self.failures = dict(sorted(failures.items()))
        own = [r for r, (exc, _) in self.failures.items() if not is_consequence(exc)]
        raised = [r for r in own if not isinstance(self.failures[r][0], CollectiveError)]
        self.root_rank = (raised or own or list(self.failures))[0]
        root_exc, root_tb = failures[self.root_rank]
        lines = [f"rank {self.root_rank} failed: {exc_line(root_exc)}"]
        others = [r for r in self.failures if r != self.root_rank]
        if others:
            lines.append("other failed ranks:")
            lines += [f"  rank {r}: {exc_line(self.failures[r][0])}" for r in others]
        lines.append(f"traceback of rank {self.root_rank}:")
        lines.append(root_tb.rstrip())
        super().__init__("\n".join(lines))

    @property
    def root_exception(self) -> BaseException:
        return self.failures[self.root_rank][0]


def exc_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def is_consequence(exc: BaseException) -> bool:
    """True when exc is (or was raised while handling / from) a PeerFailed."""
    seen: set[int] = set()
    cur: Optional[BaseException] = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, PeerFailed):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False
