"""Real ranks: the Communicator protocol over torch.distributed (gloo on CPU, NCCL on GPUs).

`DistComm(layout, rank)` runs inside one rank process whose default process group is
already initialised (harness.ranks.launcher, harness.ranks.joined do that). It creates one process group per
distinct group instance of the layout, records a `CollectiveCall` trace exactly like the
simulated ranks, keeps a one-line heartbeat file up to date (harness.ranks.heartbeat: so
that the launching parent can say which collective each rank is stuck in), and, optionally,
checks before every collective that every member of the group is calling the same collective
(harness.ranks.signature).

Semantics (the contract of runners.parallel.comm):

* all_reduce: sum over the group.
* all_gather: concatenation along dim 0 in group-rank order.
* reduce_scatter: the sum, then this member's dim-0 chunk.
* all_gather_v(t, lengths): member i contributes t[:lengths[i]] (padded to max(lengths),
  gathered, trimmed).
* broadcast(t, src): group member src's tensor (src is a group rank).
* Every result is a fresh tensor on the input's device (inputs are never modified).
  Empty tensors work (no communication is needed for them).

Bitwise determinism on gloo: gloo's ring/halving-doubling all_reduce adds the members'
contributions in an order that depends on the algorithm, the message size and the group
size, so its sums are not bitwise equal to the simulated ranks', which add in group-rank
order. On gloo every reduction is therefore an all_gather followed by a left fold in the
tensor's dtype on this rank: ``acc = x[0]; acc = acc + x[i] for i = 1..n-1`` (x[i] is
group member i's tensor). That makes gloo results bitwise comparable with the simulated
ranks (which must use the same fold), at n times the traffic (irrelevant at test sizes).
It also sidesteps gloo's missing reduce_scatter_tensor. On gloo all data movement is done
on the raw bytes (uint8 views), so every dtype works (bool, bfloat16, float8, complex).
NCCL keeps its native all_reduce / reduce_scatter (summation order is NCCL's: compare
NCCL results with a tolerance, or in integers).

Group-instance creation: torch.distributed.new_group must be called by every rank for
every group, in the same order, so every rank enumerates every instance of every Group
(WORLD, ATTN_TP, ATTN_DP; instances in order of their lowest rank) identically. WORLD
uses the default group; singleton groups (a rank alone) need no process group: their
collectives are local copies (and are still traced).
"""
from __future__ import annotations

import os
from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from harness.ranks.heartbeat import HEARTBEAT_ENV, write_heartbeat
from harness.ranks.signature import GROUP_ORDER, encode_signature, mismatch_message
from harness.ranks.trace import CollectiveCall, CollectiveMismatch
from runners.parallel.comm import DispatchedCollectives, Group
from runners.parallel.layout import ParallelLayout

CHECK_ENV = "SPECHARNESS_CHECK_COLLECTIVES"  # "1"/"0": force the signature exchange on/off

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---------------------------------------------------------------------------------------
# the communicator
# ---------------------------------------------------------------------------------------


def group_instances(layout: ParallelLayout, group: Group) -> list[tuple[int, ...]]:
    """Every distinct instance of `group`, in order of first appearance over ranks 0..ws-1."""
    seen: list[tuple[int, ...]] = []
    for r in range(layout.world_size):
        ranks = tuple(layout.group_ranks(group, r))
        if ranks not in seen:
            seen.append(ranks)
    return seen


_LOCAL = object()  # marker: a singleton group, no process group needed


class DistComm(DispatchedCollectives):
    """The Communicator protocol on an initialised torch.distributed default process group.

    check_signatures: exchange a collective signature before every collective and raise
    CollectiveMismatch on every member if they differ (None: on for gloo, off for nccl;
    the SPECHARNESS_CHECK_COLLECTIVES env var overrides the default).
    heartbeat_path: this rank's heartbeat file (None: $SPECHARNESS_HEARTBEAT_FILE, or none).
    device: where collectives run (None: the current cuda device for nccl, cpu otherwise).
    """

    def __init__(
        self,
        layout: ParallelLayout,
        rank: int,
        *,
        device: Optional[torch.device | str] = None,
        check_signatures: Optional[bool] = None,
        heartbeat_path: Optional[str] = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DistComm needs an initialised torch.distributed default process group")
        if dist.get_world_size() != layout.world_size:
            raise ValueError(f"process group has {dist.get_world_size()} ranks but {layout.describe()} needs {layout.world_size}")
        if dist.get_rank() != rank:
            raise ValueError(f"DistComm(rank={rank}) on process-group rank {dist.get_rank()}")
        self.layout = layout
        self.rank = rank
        self.world_size = layout.world_size
        self.backend = str(dist.get_backend()).lower()
        self.native = self.backend == "nccl"  # native reductions; otherwise all_gather + ordered fold on bytes
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        if check_signatures is None:
            env = os.environ.get(CHECK_ENV, "")
            check_signatures = env == "1" if env in ("0", "1") else self.backend != "nccl"
        self.check_signatures = bool(check_signatures)
        self.heartbeat_path = heartbeat_path if heartbeat_path is not None else (os.environ.get(HEARTBEAT_ENV) or None)
        self.trace: list[CollectiveCall] = []
        self._group_calls: Counter[tuple[str, tuple[int, ...]]] = Counter()
        self._my: dict[Group, tuple[int, ...]] = {g: tuple(layout.group_ranks(g, rank)) for g in GROUP_ORDER}
        self._pg: dict[Group, Any] = {}
        for g in GROUP_ORDER:  # the same order on every rank: new_group is collective over the world
            for ranks in group_instances(layout, g):
                if list(ranks) != sorted(ranks):
                    raise ValueError(f"{g.value} group {ranks}: torch.distributed orders group ranks ascending")
                if len(ranks) == 1:
                    pg: Any = _LOCAL
                elif g is Group.WORLD:
                    pg = dist.group.WORLD
                else:
                    pg = dist.new_group(list(ranks))
                if ranks == self._my[g]:
                    self._pg[g] = pg

    # ---- protocol ----
    def group_ranks(self, group: Group) -> list[int]:
        return list(self._my[Group(group)])

    def _all_reduce(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        group = Group(group)
        with self._collective("all_reduce", group, t) as (pg, n, _):
            if pg is _LOCAL or t.numel() == 0:
                return t.detach().clone()
            if self.native:
                x = t.detach().to(self.device).clone().contiguous()
                dist.all_reduce(x, op=dist.ReduceOp.SUM, group=pg)
                return x.to(t.device)
            return _fold(self._gather_parts(t, pg, n)).to(t.device)

    def _all_gather(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        group = Group(group)
        if t.dim() == 0:
            raise ValueError("all_gather concatenates along dim 0: a 0-dim tensor has none")
        with self._collective("all_gather", group, t) as (pg, n, _):
            if pg is _LOCAL:
                return t.detach().clone()
            if self.native and t.numel():
                x = t.detach().to(self.device).contiguous()
                out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=self.device)
                _all_gather_single(out, x, group=pg)
                return out.to(t.device)
            return torch.cat(self._gather_parts(t, pg, n), dim=0).to(t.device)

    def _reduce_scatter(self, t: torch.Tensor, group: Group) -> torch.Tensor:
        group = Group(group)
        n = len(self._my[group])
        if t.dim() == 0 or t.shape[0] % n:
            raise ValueError(f"reduce_scatter over {n} members needs dim 0 divisible by {n} (got shape {tuple(t.shape)})")
        with self._collective("reduce_scatter", group, t) as (pg, n, me):
            c = t.shape[0] // n
            if pg is _LOCAL or t.numel() == 0:
                return t.detach()[me * c : (me + 1) * c].clone()
            if self.native:
                x = t.detach().to(self.device).contiguous()
                out = torch.empty((c, *x.shape[1:]), dtype=x.dtype, device=self.device)
                _reduce_scatter_single(out, x, op=dist.ReduceOp.SUM, group=pg)
                return out.to(t.device)
            return _fold(self._gather_parts(t, pg, n))[me * c : (me + 1) * c].clone().to(t.device)

    def _all_gather_v(self, t: torch.Tensor, lengths: Sequence[int], group: Group) -> torch.Tensor:
        group = Group(group)
        lengths = [int(x) for x in lengths]
        n = len(self._my[group])
        me = self._my[group].index(self.rank)
        if len(lengths) != n:
            raise ValueError(f"all_gather_v over {n} members needs {n} lengths (got {lengths})")
        if t.dim() == 0 or any(x < 0 for x in lengths) or t.shape[0] < lengths[me]:
            raise ValueError(f"all_gather_v: member {me} contributes t[:{lengths[me]}] of shape {tuple(t.shape)}")
        with self._collective("all_gather_v", group, t, extra=lengths) as (pg, n, me):
            if pg is _LOCAL:
                return t.detach()[: lengths[0]].clone()
            m = max(lengths)
            buf = torch.zeros((m, *t.shape[1:]), dtype=t.dtype, device=t.device)
            buf[: lengths[me]] = t.detach()[: lengths[me]]
            if self.native and buf.numel():
                x = buf.to(self.device)
                out = torch.empty((n * m, *x.shape[1:]), dtype=x.dtype, device=self.device)
                _all_gather_single(out, x, group=pg)
                parts = list(out.view(n, m, *x.shape[1:]).unbind(0))
            else:
                parts = self._gather_parts(buf, pg, n)
            return torch.cat([p[:k] for p, k in zip(parts, lengths, strict=True)], dim=0).to(t.device)

    def _broadcast(self, t: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        group = Group(group)
        n = len(self._my[group])
        if not 0 <= src < n:
            raise ValueError(f"broadcast src is a group rank in 0..{n - 1} (got {src})")
        with self._collective("broadcast", group, t, extra=[src]) as (pg, n, _):
            if pg is _LOCAL or t.numel() == 0:
                return t.detach().clone()
            x = t.detach().to(self.device if self.native else "cpu").clone().contiguous()
            dist.broadcast(x if self.native else x.view(-1).view(torch.uint8), src=self._my[group][src], group=pg)
            return x.to(t.device)

    def barrier(self, group: Group) -> None:
        group = Group(group)
        with self._collective("barrier", group, None) as (pg, _, _):
            if pg is _LOCAL:
                return
            if self.native:
                dist.barrier(group=pg, device_ids=[self.device.index])
            else:
                dist.barrier(group=pg)

    # ---- machinery ----
    def _gather_parts(self, t: torch.Tensor, pg: Any, n: int) -> list[torch.Tensor]:
        """Every member's tensor (same shape everywhere), in group-rank order, on the cpu (gloo)."""
        x = t.detach().to("cpu").contiguous()
        if x.numel() == 0:
            return [x.clone() for _ in range(n)]
        raw = x.reshape(-1).view(torch.uint8)
        bufs = [torch.empty_like(raw) for _ in range(n)]
        dist.all_gather(bufs, raw, group=pg)
        return [b.view(x.dtype).view(x.shape) for b in bufs]

    @contextmanager
    def _collective(
        self, op: str, group: Group, t: Optional[torch.Tensor], extra: Sequence[int] = ()
    ) -> Iterator[tuple[Any, int, int]]:
        ranks = self._my[group]
        call = CollectiveCall.of(len(self.trace), op, group.value, ranks, t)
        key = (group.value, ranks)
        group_seq = self._group_calls[key]
        self._group_calls[key] += 1
        self.trace.append(call)
        self._beat(call, group_seq, "entered")
        pg = self._pg[group]
        if pg is not _LOCAL and self.check_signatures:
            self._check(call, extra, pg, ranks)
        yield pg, len(ranks), ranks.index(self.rank)
        if self.native and self.heartbeat_path and pg is not _LOCAL and not torch.cuda.is_current_stream_capturing():
            # NCCL collectives are asynchronous: without this, "left" would be written while the
            # kernel may still be waiting for a peer, and the parent would misreport a hang.
            torch.cuda.current_stream(self.device).synchronize()
        self._beat(call, group_seq, "left")

    def _beat(self, call: CollectiveCall, group_seq: int, state: str) -> None:
        write_heartbeat(
            self.heartbeat_path,
            {
                "rank": self.rank,
                "seq": call.seq,
                "call": call.describe(),
                "state": state,
                "group": call.group,
                "group_ranks": list(call.group_ranks),
                "group_seq": group_seq,
            },
        )

    def _check(self, call: CollectiveCall, extra: Sequence[int], pg: Any, ranks: tuple[int, ...]) -> None:
        sig = torch.tensor(encode_signature(call, extra), dtype=torch.int64, device=self.device if self.native else "cpu")
        bufs = [torch.empty_like(sig) for _ in ranks]
        dist.all_gather(bufs, sig, group=pg)
        msg = mismatch_message([b.tolist() for b in bufs], ranks, call.group)
        if msg is not None:
            raise CollectiveMismatch(msg)


def _fold(parts: list[torch.Tensor]) -> torch.Tensor:
    """Sum in group-rank order: ((x0 + x1) + x2) + ..., rounding to the dtype after each add."""
    acc = parts[0].clone()
    for p in parts[1:]:
        acc = acc + p
    return acc
