"""Stand-ins for what vLLM's proposer reads but a CPU cannot give: the config object, the CUDA
graph, the pipeline and DP process groups.

The config stand-in is strict (reading an attribute it lacks names the attribute: a release
that moved something ends with exit 2, not a silent default), and its derived values are the
engine's own: VllmConfig's functions (`uniform_decode_query_len` and those api.py names per
capture API), bound to it.

The DP group is real enough to agree: one thread per DP rank, and `cpu_all_reduce_` sums
every rank's tensor behind a barrier, so the engine's own coordinate-and-pad code runs on
every rank with the other ranks' real votes.
"""
from __future__ import annotations

import contextlib
import threading
import types
from typing import Any, Callable, Iterator, Optional

import torch

from harness.engines.drive import Strict as BaseStrict
from harness.engines.sglang.errors import MissingEngineAttribute


class Strict(BaseStrict):
    engine = "vllm"
    where = "harness/engines/vllm/standins.py"


def config_standin(vllm_config_cls: type, bound: tuple[str, ...], **attrs: Any) -> Strict:
    """A Strict VllmConfig whose derived sizes are computed by VllmConfig's own methods (`bound`)."""
    cls = type("VllmConfigStandIn", (Strict,), {name: getattr(vllm_config_cls, name) for name in bound})
    return cls("vllm_config", **attrs)


class FakeGraph:
    """A captured CUDA graph: what the capture pass baked, and how often it was replayed."""

    def __init__(self) -> None:
        self.baked: Optional[dict] = None
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


class GraphCapture:
    """torch.cuda.graph / CUDAGraph for the engine's capture loop: the forward run inside the
    context is recorded as the graph's bake (the recorder sets `pending`)."""

    def __init__(self) -> None:
        self.current: Optional[FakeGraph] = None
        self.piecewise: Optional[list[int]] = None  # while a manager captures: its PIECEWISE passes' token counts

    def CUDAGraph(self) -> FakeGraph:  # noqa: N802 (torch's name)
        return FakeGraph()

    @contextlib.contextmanager
    def graph(self, g: FakeGraph, pool: Any = None, stream: Any = None) -> Iterator[None]:
        self.current = g
        try:
            yield
        finally:
            self.current = None


def torch_proxy(capture: GraphCapture) -> types.SimpleNamespace:
    """The `torch` a capture module sees: real torch, except torch.cuda's graph API."""
    proxy = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    proxy.cuda = types.SimpleNamespace(CUDAGraph=capture.CUDAGraph, graph=capture.graph, Stream=object)
    return proxy


@contextlib.contextmanager
def null_graph_capture(device: Any = None, stream: Any = None) -> Iterator[types.SimpleNamespace]:
    yield types.SimpleNamespace(stream=None)


@contextlib.contextmanager
def null_pool(pool: Any, vllm_config: Any) -> Iterator[Any]:
    yield pool


class DPWorld:
    """dp_size ranks, one thread each; `group()` is the calling thread's DP group."""

    def __init__(self, dp_size: int) -> None:
        self.dp_size = dp_size
        self._barrier = threading.Barrier(dp_size)
        self._slots: list[Optional[torch.Tensor]] = [None] * dp_size
        self._local = threading.local()

    def group(self) -> "DPGroup":
        rank = getattr(self._local, "rank", None)
        if rank is None:
            raise MissingEngineAttribute("vllm asked for the DP group outside a DP rank's thread")
        return DPGroup(self, rank)

    def cpu_all_reduce_(self, rank: int, t: torch.Tensor) -> None:
        self._slots[rank] = t.clone()
        self._barrier.wait()
        total = sum(self._slots)  # type: ignore[arg-type]
        self._barrier.wait()
        t.copy_(total)

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """fn(rank) on every rank at once (each in its thread); the results in rank order."""
        out: list[Any] = [None] * self.dp_size
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            self._local.rank = rank
            try:
                out[rank] = fn(rank)
            except BaseException as e:  # re-raised on the caller's thread
                errors.append(e)
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.dp_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self._barrier.reset()
            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        return out


class DPGroup(Strict):
    def __init__(self, world: DPWorld, rank: int) -> None:
        super().__init__("dp_group", world_size=world.dp_size, rank_in_group=rank, dead_dp_ranks=())
        object.__setattr__(self, "_world", world)
        object.__setattr__(self, "cpu_group", self)  # up to 0.32 the agreement is dist.all_reduce(t, group=cpu_group)

    def cpu_all_reduce_(self, t: torch.Tensor) -> None:
        self._world.cpu_all_reduce_(self.rank_in_group, t)


def dist_standin() -> Strict:
    """torch.distributed as a release's DP agreement calls it before DP groups had cpu_all_reduce_: the
    sum over the DPWorld of `group` (a DPGroup's cpu_group is the group itself)."""
    return Strict("torch.distributed", all_reduce=lambda t, group=None: group.cpu_all_reduce_(t))
