"""The simulated ranks' combine steps: pure functions from the members' contributions, in
group-rank order, to one fresh output per member. Sums run in group-rank order, the order the
real ranks' gloo fold uses too (harness.ranks.distributed), so the two agree bitwise.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch


def _sum_in_order(ts: list[torch.Tensor]) -> torch.Tensor:
    acc = ts[0].clone()
    for t in ts[1:]:
        acc.add_(t)
    return acc


def combine_all_reduce(ts: list[torch.Tensor], params: tuple) -> list[torch.Tensor]:
    acc = _sum_in_order(ts)
    return [acc.clone() for _ in ts]


def combine_all_gather(ts: list[torch.Tensor], params: tuple) -> list[torch.Tensor]:
    full = torch.cat(ts, dim=0)
    return [full.clone() for _ in ts]


def combine_reduce_scatter(ts: list[torch.Tensor], params: tuple) -> list[torch.Tensor]:
    acc = _sum_in_order(ts)
    chunk = acc.shape[0] // len(ts)
    return [acc[i * chunk : (i + 1) * chunk].clone() for i in range(len(ts))]


def combine_all_gather_v(ts: list[torch.Tensor], params: tuple) -> list[torch.Tensor]:
    (lengths,) = params
    full = torch.cat([t[:n] for t, n in zip(ts, lengths, strict=True)], dim=0)
    return [full.clone() for _ in ts]


def combine_broadcast(ts: list[torch.Tensor], params: tuple) -> list[torch.Tensor]:
    (src,) = params
    return [ts[src].clone() for _ in ts]


def combine_barrier(ts: list[Optional[torch.Tensor]], params: tuple) -> list[None]:
    return [None for _ in ts]


Combine = Callable[[list, tuple], list]
