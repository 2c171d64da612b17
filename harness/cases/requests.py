"""A case's requests: per iteration and DP group, the schedule's batch sizes filled with requests whose prefix and
accept lengths are drawn from the case's seed, or given explicitly (schedule.prefix_lens / accept_lens / rids, which
harness.cases.case validates)."""
from __future__ import annotations

import zlib
from typing import Optional

from harness.run.scenario import Iteration, RequestSpec


def with_explicit_lens(iterations: tuple[Iteration, ...], prefix: Optional[list], accept: Optional[list], rids: Optional[list] = None) -> tuple[Iteration, ...]:
    """Override the seeded draw with schedule.prefix_lens / accept_lens / rids where given (a rid decides the request's tokens)."""
    if prefix is None and accept is None and rids is None:
        return iterations
    pick = lambda given, i, j, k, default: given[i][j][k] if given is not None else default  # noqa: E731
    out = []
    for i, it in enumerate(iterations):
        groups = []
        for j, reqs in enumerate(it.per_dp):
            groups.append(tuple(
                RequestSpec(pick(rids, i, j, k, r.rid), pick(prefix, i, j, k, r.prefix_len), pick(accept, i, j, k, r.accept_len))
                for k, r in enumerate(reqs)
            ))
        out.append(Iteration(tuple(groups)))
    return tuple(out)


def seeded_requests(seed: int, schedule: tuple[tuple[int, ...], ...], T: int, max_prefix_len: int) -> tuple[Iteration, ...]:
    """Deterministic requests for a schedule of batch sizes: prefix and accept lengths from the seed."""
    its, rid = [], 0
    for sizes in schedule:
        groups = []
        for bs in sizes:
            reqs = []
            for _ in range(bs):
                h = zlib.crc32(f"{seed}:{rid}".encode())
                reqs.append(RequestSpec(rid, 1 + h % max_prefix_len, 1 + (h >> 8) % T))
                rid += 1
            groups.append(tuple(reqs))
        its.append(Iteration(tuple(groups)))
    return tuple(its)
