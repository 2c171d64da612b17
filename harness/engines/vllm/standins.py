"""Stand-ins for what vLLM's proposer reads but a CPU cannot give: the config object, the CUDA
graph, the pipeline and DP process groups, the draft's attention backend, the draft model's
forward and its sampler (next_id_model / next_id_sampler: the id a step samples says which
step's output the next one read).

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
from harness.engines.sglang.errors import EngineAdapterError, MissingEngineAttribute
from harness.ranks.one_cpu import threads_on_one_cpu


class Strict(BaseStrict):
    engine = "vllm"
    where = "harness/engines/vllm/standins.py"


def config_standin(vllm_config_cls: type, bound: tuple[str, ...], **attrs: Any) -> Strict:
    """A Strict VllmConfig whose derived sizes are computed by VllmConfig's own methods (`bound`)."""
    cls = type("VllmConfigStandIn", (Strict,), {name: getattr(vllm_config_cls, name) for name in bound})
    return cls("vllm_config", **attrs)


class FakeGraph:
    """A captured CUDA graph: what the capture pass baked, how often it was replayed, and its body.

    A CUDA graph replays the kernels its capture launched, with the scalars and buffer views
    of that capture. The body is the call the manager made inside the capture context (its
    forward function with the capture's arguments), so a replay re-runs it: the same request
    and token counts, the same buffer views, whatever a later batch wrote into them. That is
    faithful while the body's host-side branches read only what was fixed at capture (true of
    the draft decode bodies driven: they branch on the captured metadata and step count)."""

    def __init__(self) -> None:
        self.baked: Optional[dict] = None
        self.replays = 0
        self.body: Optional[Callable[[], Any]] = None

    def replay(self) -> None:
        self.replays += 1
        if self.body is not None:
            self.body()


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


def graph_body(capture: GraphCapture, forward_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A manager's forward function whose call inside a capture context becomes that graph's body."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        g = capture.current
        if g is not None and g.body is None:
            g.body = lambda: forward_fn(*args, **kwargs)
        return forward_fn(*args, **kwargs)

    return forward


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
    """dp_size ranks, one thread each; `group()` is the calling thread's DP group.

    One rank runs at a time (it holds the turn) except inside a collective, where it gives the turn
    up until every rank has voted: the engine's code outside collectives (the Triton interpreter's
    global patching of triton.language among it) is not safe to run from several threads at once,
    and the collectives are the only points where ranks must meet."""

    def __init__(self, dp_size: int, meet_timeout_s: float = 120.0) -> None:
        self.dp_size = dp_size
        self.meet_timeout_s = meet_timeout_s  # a rank waiting longer at a collective: the ranks diverged (an error, not a hang)
        self._barrier = threading.Barrier(dp_size, timeout=meet_timeout_s)
        self._slots: list[Optional[torch.Tensor]] = [None] * dp_size
        self._local = threading.local()
        self._turn = threading.Lock()

    def group(self) -> "DPGroup":
        rank = getattr(self._local, "rank", None)
        if rank is None:
            raise MissingEngineAttribute("vllm asked for the DP group outside a DP rank's thread")
        return DPGroup(self, rank)

    def cpu_all_reduce_(self, rank: int, t: torch.Tensor) -> None:
        self._slots[rank] = t.clone()
        self._turn.release()
        try:
            self._barrier.wait()
            total = sum(self._slots)  # type: ignore[arg-type]
            self._barrier.wait()
        finally:
            self._turn.acquire()
        t.copy_(total)

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """fn(rank) on every rank at once (each in its thread); the results in rank order."""
        out: list[Any] = [None] * self.dp_size
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            # the caller's torch thread count applied to this thread now, not at its first parallel op: MKL's count is
            # per thread, and a matmul before that op would split over every core (harness/ranks/simulated.py)
            torch.set_num_threads(torch.get_num_threads())
            self._local.rank = rank
            self._turn.acquire()
            try:
                out[rank] = fn(rank)
            except BaseException as e:  # re-raised on the caller's thread
                errors.append(e)
                self._barrier.abort()
            finally:
                self._turn.release()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.dp_size)]
        with threads_on_one_cpu():  # one rank runs at a time (the turn lock): on two CPUs each hand-off crosses CPUs
            for t in threads:
                t.start()
        for t in threads:
            t.join()
        if errors:
            self._barrier.reset()
            real = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), None)
            if real is not None:
                raise real
            raise EngineAdapterError(f"the DP ranks did not all reach the same collective within {self.meet_timeout_s} s: "
                                     "a rank the others waited for finished or ran a different number of collectives")
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


DRAFT_LAYER = "draft_attn"  # the one draft attention layer the stand-in group serves


class DraftAttnBuilder:
    """The draft's attention metadata builder, for the part the proposer's graphs depend on.

    A backend derives state from the draft buffers when it builds metadata (FlashAttention's
    scheduler metadata from query_start_loc and seq_lens) and keeps it in persistent tensors a
    FULL graph reads. The non-fused loop rebuilds it on the host before every step; the fused
    graph refreshes it in place (update_draft_decode_metadata, recorded in the graph). `derived`
    is that state: the lanes and values it was last derived from, so a draft forward can be
    checked against the buffers it actually runs on. No attention kernel runs."""

    def __init__(self, supports_update: bool) -> None:
        self.supports_draft_decode_metadata_update = supports_update
        self.derived: Optional[dict[str, list[int]]] = None
        self.updates = 0

    def build(self, num_reqs: int, query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> Strict:
        md = Strict("draft_attn_metadata", num_reqs=num_reqs, query_start_loc=query_start_loc[: num_reqs + 1], seq_lens=seq_lens[:num_reqs])
        self._derive(md)
        return md

    def update_draft_decode_metadata(self, md: Strict) -> None:
        self.updates += 1
        self._derive(md)

    def _derive(self, md: Strict) -> None:
        self.derived = {"query_start_loc": md.query_start_loc.tolist(), "seq_lens": md.seq_lens.tolist()}


class DraftAttnGroup(Strict):
    """An AttentionGroup of the draft's one layer, with a backend that says whether it can update
    draft-decode metadata in place: the fact the release's own configuration step
    (_configure_decode_metadata_update, _configure_fused_multi_step_decode up to 0.31) reads to
    choose the fused multi-step decode graph or the per-step loop."""

    def __init__(self, supports_update: bool) -> None:
        super().__init__("attn_group", backend=Strict("attn_backend", get_name=lambda: "ENGINE_CHECK_DRAFT_ATTN"),
                         layer_names=[DRAFT_LAYER], kv_cache_group_id=0, supports_draft_decode_metadata_update=supports_update,
                         builder=DraftAttnBuilder(supports_update))

    def build(self, num_reqs: int, query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> dict[str, Any]:
        return {DRAFT_LAYER: self.builder.build(num_reqs, query_start_loc, seq_lens)}

    def update_draft_decode_metadata(self, attn_metadata: dict[str, Any]) -> None:
        self.builder.update_draft_decode_metadata(attn_metadata[DRAFT_LAYER])

    def map_to_kernel_block_table(self, block_table: torch.Tensor, ubatch_idx: int = 0) -> torch.Tensor:
        return block_table  # kernel blocks are the KV blocks (no kernel_block_size)


class ModelStateStandIn(Strict):
    """The model state's prepare_attn, which the engine's prepare_inputs_to_capture calls to build a
    capture's metadata through the backends' builders (the draft group's, here) from its dummy batch."""

    def __init__(self) -> None:
        super().__init__("model_state")

    def prepare_attn(self, input_batch: Any, cg_mode: Any, block_tables: Any, slot_mappings: Any, attn_groups: list, kv_cache_config: Any,
                     for_capture: bool = False) -> dict[str, Any]:
        return build_metadata(attn_groups, input_batch.num_reqs, input_batch.query_start_loc, input_batch.seq_lens)


def build_metadata(attn_groups: list, num_reqs: int, query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> dict[str, Any]:
    """Every group's metadata over the first num_reqs requests of these buffers (views, as a backend's)."""
    out: dict[str, Any] = {}
    for groups in attn_groups:
        for g in groups:
            out.update(g.build(num_reqs, query_start_loc, seq_lens))
    return out


def next_id_model(spec: Any, num_tokens: int, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft model's forward inside the engine's draft step: its hidden state is the input id each token read, so what
    a step samples tells which ids that step's forward was given."""
    hidden = spec.input_buffers.input_ids[:num_tokens].to(spec.hidden_states.dtype).unsqueeze(1)
    return hidden, hidden


def next_id_sampler(spec: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """sample_draft: the id after the one each request's forward read (a prediction a check writes without running it)."""
    return hidden_states[:, 0].round().to(torch.int64) + 1
