"""Graph stand-ins: what the CUDA graph would read, snapshotted where it would launch.

* The model (ModelProbe): never run. The capture body calls it with the capture-time
  batch; it hands the batch to the runner's handle and stops the body (StopBody). Where a
  replay drives the body past the model call, the handle answers with the deterministic
  stand-in model's output instead (harness/engines/after_model.py).
* The attention backend: a subclass of the release's own AttentionBackend (its defaults
  stay the engine's, AttnRecorder mixed in) that plans nothing and records the view it is
  given at replay (seq_lens_sum); get_cuda_graph_seq_len_fill_value() is 1, as our runners use.
* The CUDA graph: FakeGraph (legacy) / FakeGraphBackend (later) stand where the graph is
  created, captured and launched, and call the handle back at each of those points.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NoReturn, Optional, Protocol

import torch

from harness.engines.sglang.errors import EngineAdapterError, MissingEngineAttribute


class GraphHost(Protocol):
    """What the stand-ins call back: the runner handle that owns them."""

    def run_body_until_model(self, bs: int, run_once: Callable) -> None: ...

    def fake_output(self, bs: int) -> Any: ...

    def on_replay(self, bs: int) -> None: ...

    def on_model_forward(self, fb: Any) -> Any: ...


@dataclass
class Snapshot:
    bs: int
    global_num_tokens_gpu: Optional[list[int]]
    global_num_tokens_for_logprob_gpu: Optional[list[int]]
    gpu_shape: Optional[tuple[int, ...]]
    seq_lens: list[int]
    lanes: dict[str, Optional[list[int]]]  # the buffers the graph reads, whole
    path: str  # which fill filled them: "" (the runner's Python), "gpu" (the Triton kernel), "npu" (the native twin)
    native: Optional[dict[str, Optional[list[int]]]]  # the native twin's result beside the kernel's, on clones


def tolist(t: Optional[torch.Tensor]) -> Optional[list[int]]:
    return None if t is None else [int(x) for x in t.reshape(-1).tolist()]


# AttentionBackend.init_forward_metadata_replay_cuda_graph's parameters after seq_lens_sum (releases up to 0.5.12)
REPLAY_HOOK_TAIL = ("encoder_lens", "forward_mode", "spec_info", "seq_lens_cpu")


class AttnRecorder:
    """Mixed into a subclass of the engine's own AttentionBackend (its defaults stay the engine's):
    plans nothing; records the batch view it is given at replay (its seq_lens_sum)."""

    # the capability probe the worker selects its multi-layer composite by: True as FA3 answers (one graph for all
    # steps, 0.5.16 on), False as flashinfer / triton do (a graph per step); set per instance by the builder
    captures_in_graph = False

    def __init__(self) -> None:
        self.last_replay_view: Any = None
        self.in_graph_hook: Optional[Callable[[Any], None]] = None  # called where a replayed graph refreshes this step's metadata

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args: Any, **kwargs: Any) -> None:
        pass

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # as runners.draft_extend.SEQ_LEN_FILL_VALUE (flashinfer / triton / fa3 backends say 1 too)

    def draft_extend_metadata_captured_in_graph(self) -> bool:
        return self.captures_in_graph  # False: replay plans out of graph, where we can see what it is given

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False, *args: Any, **kwargs: Any) -> None:
        if not in_capture:
            self.last_replay_view = forward_batch

    def init_forward_metadata_in_graph(self, forward_batch: Any, *args: Any, **kwargs: Any) -> None:
        if self.in_graph_hook is not None:
            self.in_graph_hook(forward_batch)

    # the hooks of releases up to 0.5.12 (keyword arguments, no forward batch)
    def init_forward_metadata_capture_cuda_graph(self, *args: Any, **kwargs: Any) -> None:
        pass

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: Any, seq_lens: Any, seq_lens_sum: Any, *args: Any, **kwargs: Any) -> None:
        # the hook's parameters after seq_lens_sum, by the engine's AttentionBackend's names: the replay's view, whole
        rest = dict(zip(REPLAY_HOOK_TAIL, args, strict=False), **kwargs)
        self.last_replay_view = types.SimpleNamespace(batch_size=bs, req_pool_indices=req_pool_indices, seq_lens=seq_lens,
                                                      seq_lens_sum=seq_lens_sum, **rest)

    def init_forward_metadata(self, forward_batch: Any) -> None:
        raise EngineAdapterError("the engine planned attention for an eager forward; engine-check drives graph runners only")

    def forward_extend(self, *args: Any, **kwargs: Any) -> Any:
        raise EngineAdapterError("the engine ran attention; engine-check never runs the model")

    forward_decode = forward_extend


class FakeGraph:
    """legacy generation: stands in for torch.cuda.CUDAGraph."""

    def __init__(self, handle: "GraphHost", bs: int) -> None:
        self.handle, self.bs = handle, bs

    def replay(self) -> None:
        self.handle.on_replay(self.bs)

    def pool(self) -> None:
        return None


class FakeGraphBackend:
    """runner / prepare generations: stands in for the decode graph backend (capture_one / replay); DecodeCudaGraphRunner's
    capture loop and replay open a session around them (a stream on a GPU, none here)."""

    def __init__(self, handle: "GraphHost") -> None:
        self.handle = handle
        self.outputs: dict[int, Any] = {}

    def capture_one(self, shape_key: Any, run_once: Callable, *args: Any, **kwargs: Any) -> None:
        bs = int(shape_key.size)
        self.handle.run_body_until_model(bs, run_once)
        self.outputs[bs] = self.handle.fake_output(bs)

    def replay(self, shape_key: Any, forward_batch: Any) -> Any:
        bs = int(shape_key.size)
        self.handle.on_replay(bs)
        return self.outputs[bs]

    def can_run(self, forward_batch: Any, key: Any) -> bool:
        size = int(getattr(key, "size", key))
        return size in self.outputs

    @contextlib.contextmanager
    def capture_session(self, stream: Any) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def replay_session(self) -> Iterator[None]:
        yield

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise MissingEngineAttribute(f"the engine read its graph backend's {name}, which the adapter's backend does not provide")


class StopBody(Exception):
    """Raised by the model stand-in: the step body has run up to the model, which is all we need.
    Carries what the body had set up by then (stop_at_model's tuple)."""


def baked_at_model(fb: Any, gathered: Any, what: str) -> tuple[Any, dict[str, Any], Optional[list[int]], Optional[list[int]]]:
    """The model call of a capture body: what the graph bakes is the batch, the DP buffer the body
    set and the gathered gpu tensors (held by `gathered`: the runner's buffers or the batch)."""
    if not DP_CALLS:
        raise EngineAdapterError(f"{what} called the model without set_dp_buffer_len")
    return fb, dict(DP_CALLS[-1]), tolist(gathered.global_num_tokens_gpu), tolist(gathered.global_num_tokens_for_logprob_gpu)


def stop_at_model(fb: Any, gathered: Any, what: str) -> NoReturn:
    raise StopBody(baked_at_model(fb, gathered, what))


def run_until_model(run_once: Callable, what: str) -> tuple[Any, dict[str, Any], Optional[list[int]], Optional[list[int]]]:
    """Run a captured step body (the warm-up) up to its model call, whose stand-in stops it there."""
    DP_CALLS.clear()
    try:
        run_once()
    except StopBody as stop:
        return stop.args[0]
    raise EngineAdapterError(f"{what} never called the model")


class ModelProbe:
    """The draft model: never run. Its forward() hands the batch to the runner handle and stops the body."""

    def __init__(self, shared_experts_config: Any = None) -> None:
        self.handle: Optional["GraphHost"] = None
        self.shared_experts_config = shared_experts_config  # read by later releases to scope replay

    def forward(self, input_ids: Any, positions: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        if self.handle is None:
            raise EngineAdapterError("the engine ran the draft model outside a capture the adapter drove")
        return self.handle.on_model_forward(forward_batch)

    __call__ = forward

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise MissingEngineAttribute(f"the engine read model.{name}, which the adapter's model stand-in does not provide")


# Calls of set_dp_buffer_len made through the runner modules (the step body's DP buffer setup).
DP_CALLS: list[dict[str, Any]] = []


def import_quietly(*names: str) -> tuple[Optional[list[types.ModuleType]], str]:
    """The release's modules, imported with their import-time warnings silenced; or None and why (an import the release
    needs that the stubs lack: the runner is not driven, which is no verdict on the engine)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return [importlib.import_module(n) for n in names], ""
    except Exception as e:
        return None, f"importing {', '.join(names)} raised {type(e).__name__}: {e}"


def missing_api(cls: Any, names: tuple[str, ...]) -> list[str]:
    """The methods of the API the adapter drives that a release's class lacks (all of them where the class is absent)."""
    return [n for n in names if cls is None or not hasattr(cls, n)]


def prepare_runner_module(mod: types.ModuleType, noop: Callable[..., None]) -> None:
    """A runner module as the adapter drives it: its step body's set_dp_buffer_len recorded (once), and the flashinfer
    autotuning that runs the body (the model) before capture left out (nothing to tune without a GPU)."""
    if not hasattr(mod.set_dp_buffer_len, "__wrapped_engine__"):
        mod.set_dp_buffer_len = recording_set_dp_buffer_len(mod.set_dp_buffer_len)
    if hasattr(mod, "maybe_flashinfer_autotune_speculative_draft"):
        mod.maybe_flashinfer_autotune_speculative_draft = noop


def recording_set_dp_buffer_len(real: Callable) -> Callable:
    sig = inspect.signature(real)

    def set_dp_buffer_len(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        DP_CALLS.append(dict(bound.arguments))
        return real(*args, **kwargs)

    set_dp_buffer_len.__wrapped_engine__ = real  # type: ignore[attr-defined]
    return set_dp_buffer_len
