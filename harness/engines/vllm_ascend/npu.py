"""The Ascend runtime a CPU lacks: `torch_npu` and `torch.npu` as vllm-ascend's speculative graph path calls them.

An ACL graph replays the kernels its capture launched, with that capture's buffer views and
host scalars, except for attention: each fused-infer-attention (FIA) call captured inside a
task group (graph_task_group_begin/end) is a task whose host parameters (the query and KV
lengths, the block table) the host rewrites for each replay (graph_task_update_begin/end,
vllm-ascend's update_graph_params, issued after the replay and ordered before the task by the
events the capture recorded). That is the mechanism checked here, so it is what this stand-in
records:

  AclGraph      one captured graph: its body (the call made inside the capture, re-run at
                replay under the capture's forward context, as the vLLM adapter's graphs are),
                its output (a replay writes into it), its FIA tasks in capture order
  FiaTask       one captured attention task: the parameters it was captured with and every
                update the host issued, each stamped with the graph's replay count then
  KvWrite       one _npu_reshape_and_cache launch: the slots it wrote (PADDING_SLOT_ID skipped)

Every other torch_npu name resolves to an op that refuses to run, naming itself: a release
whose driven path reaches a new NPU op ends the check with exit 2, never a silent no-op.
"""
from __future__ import annotations

import contextlib
import copy
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from harness.engines.sglang.errors import EngineAdapterError

# The FIA parameters a task is checked on (npu_fused_infer_attention_score's own keyword names)
FIA_PARAMS = ("actual_seq_lengths", "actual_seq_lengths_kv", "block_table")


@dataclass
class FiaTask:
    """A captured attention task: captured with `captured`; `updates` are (replay number, params) the host issued."""

    graph: "AclGraph"
    index: int  # its place among the graph's tasks (capture order)
    query_rows: int  # rows of the query the captured kernel runs on (TND: the last actual_seq_lengths must equal it)
    captured: dict[str, Any]
    updates: list[tuple[int, dict[str, Any]]] = field(default_factory=list)


@dataclass
class KvWrite:
    rows: int
    slots: list[int]


class AclGraph:
    """torch.npu.NPUGraph: see the module docstring."""

    def __init__(self, runtime: "NpuRuntime") -> None:
        self.runtime = runtime
        self.body: Optional[Callable[[], Any]] = None
        self.output: Any = None
        self.context: Any = None  # the forward context the capture ran under (a copy)
        self.baked: dict[str, Any] = {}  # the host values the captured call was made with (drive.py fills it)
        self.tasks: list[FiaTask] = []
        self.replays = 0

    def replay(self) -> None:
        """The body re-run with the capture's arguments under a copy of the capture's forward context (what the graph's
        kernels were recorded with; the copy takes the body's host-side writes, which a device replay never makes), its
        result written into the captured output."""
        if self.body is None:
            raise EngineAdapterError("an ACL graph was replayed that captured no call")
        self.replays += 1
        ctx = copy.copy(self.context)
        if ctx is not None:
            ctx.capturing = False
        with self.runtime.forward_context.override_forward_context(ctx), self.runtime.replaying(self), torch.inference_mode():
            _copy_into(self.output, self.body())


def _copy_into(out: Any, result: Any) -> None:
    if isinstance(out, torch.Tensor):
        out.copy_(result)
    elif isinstance(out, (list, tuple)):
        for o, r in zip(out, result, strict=True):
            _copy_into(o, r)


@dataclass
class _RankState:
    """What one DP rank's stream has going on (ranks are threads here, processes in a deployment)."""

    capturing: Optional[AclGraph] = None
    replaying_graph: Optional[AclGraph] = None
    replay_task: int = 0  # the next task of the replaying graph an attention launch runs as
    updating: Optional[FiaTask] = None
    group_open: Optional[dict[str, Any]] = None  # a task group begun in the capture, its FIA call not yet seen
    kv_writes: list[KvWrite] = field(default_factory=list)


class NpuRuntime:
    """The stand-ins' shared state, one _RankState per DP rank (`rank_of` names the calling thread's rank)."""

    def __init__(self) -> None:
        self.rank_of: Callable[[], int] = lambda: 0
        self.forward_context: Any = None  # vllm.forward_context, once the loader has imported it
        self._ranks: dict[int, _RankState] = {}

    def state(self) -> _RankState:
        return self._ranks.setdefault(self.rank_of(), _RankState())

    @property
    def capturing(self) -> Optional[AclGraph]:
        return self.state().capturing

    @property
    def kv_writes(self) -> list[KvWrite]:
        return self.state().kv_writes

    @contextlib.contextmanager
    def replaying(self, g: AclGraph) -> Iterator[None]:
        st = self.state()
        st.replaying_graph, st.replay_task = g, 0
        try:
            yield
        finally:
            st.replaying_graph = None
        if st.replay_task != len(g.tasks):
            raise EngineAdapterError(f"an ACL graph replay launched {st.replay_task} attention kernels where its capture "
                                     f"recorded {len(g.tasks)} tasks")

    # torch.npu.graph(g, pool=...)
    @contextlib.contextmanager
    def graph(self, g: AclGraph, pool: Any = None, stream: Any = None) -> Iterator[None]:
        fc = self.forward_context
        st = self.state()
        if st.capturing is not None:
            raise EngineAdapterError("an ACL graph capture began inside another")
        g.context = copy.copy(fc.get_forward_context()) if fc.is_forward_context_available() else None
        st.capturing = g
        try:
            yield
        finally:
            st.capturing = None

    def graph_task_group_begin(self, stream: Any) -> None:
        st = self.state()
        if st.capturing is None:
            raise EngineAdapterError("graph_task_group_begin outside an ACL graph capture")
        st.group_open = {}

    def graph_task_group_end(self, stream: Any) -> FiaTask:
        st = self.state()
        if st.capturing is None or st.group_open is None or "params" not in st.group_open:
            raise EngineAdapterError("graph_task_group_end without a captured attention launch in its group")
        g = st.capturing
        task = FiaTask(g, len(g.tasks), st.group_open["rows"], st.group_open["params"])
        g.tasks.append(task)
        st.group_open = None
        return task

    def graph_task_update_begin(self, stream: Any, handle: FiaTask) -> None:
        if not isinstance(handle, FiaTask):
            raise EngineAdapterError(f"graph_task_update_begin on {handle!r}, not a captured task handle")
        self.state().updating = handle

    def graph_task_update_end(self, stream: Any) -> None:
        self.state().updating = None

    def fia_out(self, query: torch.Tensor, **kw: Any) -> None:
        """npu_fused_infer_attention_score.out: a launch inside a capture's task group, or an update of a task."""
        st = self.state()
        params = {k: _host(kw.get(k)) for k in FIA_PARAMS}
        if st.updating is not None:
            task = st.updating
            task.updates.append((task.graph.replays, params))
            return
        if st.group_open is None:
            raise EngineAdapterError("npu_fused_infer_attention_score.out outside a task group or a task update")
        st.group_open.update(params=params, rows=int(query.shape[0]))
        _fill_attention(kw["out"][0], query)

    def fia(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """npu_fused_infer_attention_score: eager (a warm-up), or inside a replayed graph's body its next captured task (what
        it runs with is the task's captured parameters as the host last rewrote them: FiaTask.updates)."""
        st = self.state()
        g = st.replaying_graph
        if g is not None:
            if st.replay_task >= len(g.tasks):
                raise EngineAdapterError(f"an ACL graph replay launched more attention kernels than its {len(g.tasks)} tasks")
            st.replay_task += 1
        out = torch.empty_like(query)
        _fill_attention(out, query)
        return out, torch.empty(1, dtype=query.dtype)

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          slot_indices: torch.Tensor) -> None:
        """_npu_reshape_and_cache: row i of key/value into slot slot_indices[i] of the paged cache; negative slots skipped.
        A slot past the cache is recorded and not written (on a device it corrupts memory; here the checks name it)."""
        slots = [int(s) for s in slot_indices.tolist()]
        if len(slots) != key.shape[0]:
            raise EngineAdapterError(f"_npu_reshape_and_cache given {key.shape[0]} key rows and {len(slots)} slots")
        st = self.state()
        if st.capturing is not None:  # a capture records the kernel; it runs at each replay
            return
        flat_k = key_cache.view(-1, *key_cache.shape[2:])
        flat_v = value_cache.view(-1, *value_cache.shape[2:])
        for i, s in enumerate(slots):
            if 0 <= s < flat_k.shape[0]:
                flat_k[s] = key[i]
                flat_v[s] = value[i]
        st.kv_writes.append(KvWrite(len(slots), slots))


def _fill_attention(out: torch.Tensor, query: torch.Tensor) -> None:
    """The stand-in kernel's result: the query itself (no attention is computed; what it ran with is what is checked)."""
    out.view(-1)[: query.numel()].copy_(query.reshape(-1)[: out.numel()])


def _host(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.tolist()
    return list(v) if isinstance(v, (list, tuple)) else v


class RankTables:
    """One of acl_graph's module-global parameter tables (GraphParams: per captured size, its attention tasks' params,
    handles, events, workspaces) per DP rank. In a deployment each rank is a process with its own; here the ranks share
    one, so the global holds this and every read resolves to the calling rank's table."""

    def __init__(self, runtime: "NpuRuntime") -> None:
        object.__setattr__(self, "runtime", runtime)
        object.__setattr__(self, "tables", {})

    def __getattr__(self, name: str) -> Any:
        rank = self.runtime.rank_of()
        if rank not in self.tables:
            raise EngineAdapterError(f"rank {rank} read an ACL graph parameter table before setting it")
        return getattr(self.tables[rank], name)


class _Refused:
    """A torch_npu name the driven path was never seen to call: reading it is fine (modules read dtypes and ops at
    import), calling it ends the check naming it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise EngineAdapterError(f"the driven path called {self._name}, an NPU op the vllm-ascend adapter does not stand in for: "
                                 "add it to harness/engines/vllm_ascend/npu.py")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Refused(f"{self._name}.{name}")

    def __or__(self, other: Any) -> Any:  # `torch_npu._C.X | None` in annotations evaluated at import
        return self

    __ror__ = __or__


class _Namespace(types.ModuleType):
    """A module whose given names are stand-ins and whose other names are _Refused."""

    def __init__(self, name: str, **attrs: Any) -> None:
        super().__init__(name)
        self.__dict__.update(attrs)
        self.__path__: list[str] = []  # a package: `import torch_npu.X` resolves through sys.modules

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Refused(f"{self.__name__}.{name}")


class _Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass


class _Event:
    """torch.npu.ExternalEvent / Event: ordering between the update stream and a replay; a replay here runs on the host
    in program order, so the order they enforce already holds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def reset(self, stream: Any = None) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _FiaOp:
    """torch_npu.npu_fused_infer_attention_score: the op (eager) and its .out overload (captured or updated)."""

    def __init__(self, runtime: NpuRuntime) -> None:
        self.runtime = runtime

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.runtime.fia(*args, **kwargs)

    def out(self, *args: Any, **kwargs: Any) -> None:
        self.runtime.fia_out(*args, **kwargs)


def build_modules(runtime: NpuRuntime) -> tuple[types.ModuleType, types.ModuleType]:
    """(torch.npu, torch_npu) over `runtime`."""

    @contextlib.contextmanager
    def stream(s: Any) -> Iterator[None]:
        yield

    npu = _Namespace(
        "torch.npu", NPUGraph=type("NPUGraph", (AclGraph,), {"__init__": lambda self: AclGraph.__init__(self, runtime)}), graph=runtime.graph,
        Stream=_Stream, Event=_Event, ExternalEvent=_Event,
        stream=stream, current_stream=lambda device=None: _Stream(), default_stream=lambda device=None: _Stream(),
        is_current_stream_capturing=lambda: runtime.state().capturing is not None, synchronize=lambda device=None: None,
        empty_cache=lambda: None, graph_task_group_begin=runtime.graph_task_group_begin, graph_task_group_end=runtime.graph_task_group_end,
        graph_task_update_begin=runtime.graph_task_update_begin, graph_task_update_end=runtime.graph_task_update_end,
        is_available=lambda: False, device_count=lambda: 0,
    )
    fia = _FiaOp(runtime)
    torch_npu = _Namespace(
        "torch_npu", npu=npu, npu_fused_infer_attention_score=fia, _npu_reshape_and_cache=runtime.reshape_and_cache,
        # the KV write later releases' device adaptor calls: the same scatter by slot (cache_mode "Norm")
        npu_scatter_pa_kv_cache=lambda key, value, key_cache, value_cache, slot_mapping, cache_mode="Norm":
            runtime.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping),
        _npu_fused_infer_attention_score_get_max_workspace=lambda **kw: torch.empty(0),
        _C=_Namespace("torch_npu._C", _weak_ref_tensor=lambda t: t, _NPUTaskGroupHandle=FiaTask),
    )
    return npu, torch_npu
