"""The engine adapter: drive an installed SGLang's EAGLE draft-extend graph runners on a CPU.

`harness engine-check` points our P1 invariants at the engine's own code. SGLang's runner
modules are plain Python; what they compute on the host -- the forward batch that
`get_forward_batch(bs)` / the capture path bakes per bucket, what replay / prepare fills in,
the bucket it picks -- is exactly where the seed bug lived. This module is the only place
that knows SGLang: every stub, shim and patch lives here and is documented here.
harness/engine_check.py sees only our own records (runners.cuda_graph.CaptureRecord /
ReplayRecord) and runs harness.properties on them.

What is real
------------
The runner classes and their __init__; the multi-step composite that owns the shared
buffers (its _init_and_capture, reset_buffers / prepare, replay); get_batch_sizes_to_capture;
require_*_gather; ServerArgs and, where the release has one, the runtime context it is
published into; ForwardBatch; the capture path (capture_one_batch_size / capture_one_shape,
get_forward_batch, attention planning, the step body up to the model call, including its
set_dp_buffer_len); replay / execute / prepare up to the graph launch; and the logits
processor's own row selection (LogitsMetadata.from_forward_batch +
LogitsProcessor._get_pruned_states), which says how many rows a captured batch feeds lm_head.

What is not, and why
--------------------
* Third-party imports (STUBBED_MODULES): a meta-path finder serves package-like stub
  modules whose attributes are real, subclassable classes (instances are falsy and absorb
  calls and attribute reads; a stub called on a function returns it, so decorators work).
  Only the listed names are stubbed, and always, even where the host has them installed,
  so a check does not depend on what else the machine has; anything else missing still
  raises ImportError (SGLang probes optional kernels with try/except ImportError and must
  keep seeing them absent). REAL_MODULES are imported for real (msgspec structs, triton.jit,
  regex, dill, packaging at import time); harness/engine_install.py provides them.
* The worker and the model runner: strict stand-ins (`_Strict`) carrying the attributes the
  runner code reads. Reading one they lack raises MissingEngineAttribute naming the owner
  and the attribute: a release that moves something fails saying what it now reads.
* The model (`_ModelProbe`): never run. The capture body calls it with the capture-time
  batch; it records the batch, the DP buffer the body just set and the gathered gpu
  tensors, and stops the body (_StopBody). Nothing after the model call runs (top-k,
  the in-graph chain writes): they need the model's output and GPU kernels.
* The attention backend: a subclass of the release's own AttentionBackend (its defaults
  stay the engine's) that plans nothing and records the view it is given at replay
  (seq_lens_sum); get_cuda_graph_seq_len_fill_value() is 1, as our runners use.
* The CUDA graph: `_FakeGraph` (legacy) / `_FakeGraphBackend` (later) stand where the graph
  is created, captured and launched. At launch they snapshot the static buffers the graph
  would read (the gathered gpu tensors, seq_lens); the output is the captured batch's
  logits buffer, so the rows handed back after replay are the engine's own slicing.
* Parallel groups: fake groups of the right sizes and ranks, set where the release reads
  them (parallel_state / dp_attention globals), or a rank bundle given to publish().
* prepare()'s fused fill kernel is Triton on a GPU; the module ships
  fill_draft_extend_prepare_buffers_native, "mirroring the triton kernel's semantics
  exactly" (its docstring), which is swapped in. flashinfer autotuning (runs the model) and
  get_available_gpu_memory (logging) are no-ops.
* Between multi-layer steps the engine advances the chain inside the graph
  (assign_new_state / rotate_input_ids, GPU kernels): not run, so steps > 0 are replayed
  with step 0's token buffers. No value the checks read depends on them.

API generations (detected from the classes; the versions are the ones checked)
-------------------------------------------------------------------------------
  legacy   0.5.12.post1, 0.5.13.post1: runners own `graphs` / `output_buffers`; capture is
           capture_one_batch_size; replay(forward_batch, init_state); per-step widths
           num_steps + 1 + step; require_*(server_args); 0.5.12 plans attention with
           init_forward_metadata_{capture,replay}_cuda_graph.
  runner   0.5.14: runners subclass DecodeCudaGraphRunner with a graph backend
           (resolve_decode_backend); capture_one_shape; execute(forward_batch).
  prepare  0.5.18, 0.5.20, 0.5.23: the composite owns one buffer set and one width for all
           steps; prepare(forward_batch) fills it (fused kernel), replay(step) replays;
           logits pruned to a row per request where no gathered buffer is needed; server
           args published into a runtime context (0.5.23: with the rank bundle).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import logging
import sys
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from runners.cuda_graph import CaptureRecord, ReplayRecord
from runners.parallel.layout import Branch, ParallelLayout

# ----------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------


class EngineAdapterError(RuntimeError):
    """The installed engine does not look like anything this adapter knows how to drive."""


class MissingEngineAttribute(AttributeError):
    """The engine read an attribute that our stand-in does not provide (a release moved something)."""


# ----------------------------------------------------------------------------------------
# imports: real modules and the stub finder
# ----------------------------------------------------------------------------------------

# Imported for real: the runner modules use them at import time.
REAL_MODULES = ("triton", "msgspec", "regex", "dill", "packaging")

# Third-party top-level imports of the modules we load, stubbed. Found by importing the
# runner modules with nothing but torch, numpy and REAL_MODULES available (0.5.12.post1 ..
# 0.5.23). A release that imports a new one fails with ModuleNotFoundError naming it: add
# it here.
STUBBED_MODULES = (
    "aiohttp", "compressed_tensors", "einops", "fastapi", "gguf", "huggingface_hub", "IPython",
    "openai", "orjson", "yaml", "partial_json_parser", "PIL", "psutil", "pybase64", "pydantic",
    "pydantic_core", "requests", "safetensors", "sentencepiece", "setproctitle", "starlette",
    "torchao", "torchvision", "tqdm", "transformers", "tvm_ffi", "uvicorn", "uvloop", "xgrammar", "zmq",
)

# Dunder attributes a stub answers (SGLang's transformers patches read them at import);
# every other dunder raises AttributeError, so protocols (pickle, inspect, typing) behave.
_STUB_DUNDERS = {"__func__": None, "__class_validators__": []}


class _Anything:
    """A value that absorbs use: call it, read or set attributes, index it, iterate (empty), test it (False)."""

    __slots__ = ("_path",)

    def __init__(self, path: str = "stub") -> None:
        object.__setattr__(self, "_path", path)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            if name in _STUB_DUNDERS:
                return self
            raise AttributeError(name)
        return _Anything(f"{self._path}.{name}")

    def __setattr__(self, name: str, value: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], _Anything):
            return args[0]  # used as a decorator: keep the function
        return _Anything(f"{self._path}()")

    def __getitem__(self, key: Any) -> Any:
        return _Anything(f"{self._path}[]")

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def __contains__(self, key: Any) -> bool:
        return False

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __bool__(self) -> bool:
        return False

    def __or__(self, other: Any) -> Any:  # `X | None` in annotations evaluated at import
        return self

    __ror__ = __or__

    def __repr__(self) -> str:
        return f"<stub {self._path}>"


class _StubMeta(type):
    """Metaclass of stub classes: class-level reads give stub values; X[...] and X | Y work."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            if name in _STUB_DUNDERS:
                return _STUB_DUNDERS[name] if _STUB_DUNDERS[name] is not None else _Anything(f"{cls.__name__}.{name}")
            raise AttributeError(name)
        return _Anything(f"{cls.__module__}.{cls.__name__}.{name}")

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], type):
            return args[0]  # a stub used as a decorator keeps the function
        return super().__call__(*args, **kwargs)

    def __or__(cls, other: Any) -> Any:
        return cls

    __ror__ = __or__


class _StubClass(metaclass=_StubMeta):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __init_subclass__(cls, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # a decorator factory's result applied to a function
        return _Anything(f"{type(self).__name__}()()")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{type(self).__name__}().{name}")

    # an instance is what a stubbed function returns (`is_flash_attn_available()`): falsy and empty,
    # so feature probes answer "not available"
    def __bool__(self) -> bool:
        return False

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __contains__(self, key: Any) -> bool:
        return False

    def __getitem__(self, key: Any) -> Any:
        return _Anything(f"{type(self).__name__}()[]")


class StubModule(types.ModuleType):
    """A package-like module: every public attribute is a real, subclassable stub class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _StubMeta(name, (_StubClass,), {"__module__": self.__name__, "__qualname__": name})
        setattr(self, name, value)
        return value


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves StubModule for the listed top-level names (and their submodules), nothing else."""

    def __init__(self, names: tuple[str, ...] = STUBBED_MODULES) -> None:
        self.names = frozenset(names)
        self.served: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname.split(".")[0] not in self.names:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = StubModule(spec.name)
        mod.__path__ = []  # a package: submodule imports come back here
        mod.__file__ = None
        self.served.add(spec.name.split(".")[0])
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        pass


# ----------------------------------------------------------------------------------------
# strict stand-ins for the objects the runners read
# ----------------------------------------------------------------------------------------


class _Strict:
    """Attributes given at construction; reading any other raises MissingEngineAttribute naming it."""

    def __init__(self, _name: str, **attrs: Any) -> None:
        object.__setattr__(self, "_name", _name)
        for k, v in attrs.items():
            object.__setattr__(self, k, v)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise MissingEngineAttribute(
            f"the engine read {self._name}.{name}, which the engine adapter's stand-in does not provide "
            f"(a release moved something: add it to harness/engine_adapter.py)"
        )

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


class _FakeGroup:
    """A process group of one axis: sizes and ranks only; any collective is an adapter error."""

    def __init__(self, name: str, world_size: int, rank_in_group: int) -> None:
        self.name, self.world_size, self.rank_in_group = name, world_size, rank_in_group
        self.rank = rank_in_group

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise MissingEngineAttribute(f"the engine used {self.name}_group.{name}; the adapter's groups have sizes and ranks only")


# ----------------------------------------------------------------------------------------
# graph stand-ins: what the graph would read, snapshotted where it would launch
# ----------------------------------------------------------------------------------------


@dataclass
class _Snapshot:
    bs: int
    global_num_tokens_gpu: Optional[list[int]]
    global_num_tokens_for_logprob_gpu: Optional[list[int]]
    gpu_shape: Optional[tuple[int, ...]]
    seq_lens: list[int]


def _tolist(t: Optional[torch.Tensor]) -> Optional[list[int]]:
    return None if t is None else [int(x) for x in t.reshape(-1).tolist()]


class _AttnRecorder:
    """Mixed into a subclass of the engine's own AttentionBackend (its defaults stay the engine's):
    plans nothing; records the batch view it is given at replay (its seq_lens_sum)."""

    def __init__(self) -> None:
        self.last_replay_view: Any = None

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args: Any, **kwargs: Any) -> None:
        pass

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # as runners.draft_extend.SEQ_LEN_FILL_VALUE (flashinfer / triton / fa3 backends say 1 too)

    def draft_extend_metadata_captured_in_graph(self) -> bool:
        return False  # so replay plans out of graph, where we can see what it is given

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False, *args: Any, **kwargs: Any) -> None:
        if not in_capture:
            self.last_replay_view = forward_batch

    def init_forward_metadata_in_graph(self, forward_batch: Any, *args: Any, **kwargs: Any) -> None:
        pass

    # the hooks of releases up to 0.5.12 (keyword arguments, no forward batch)
    def init_forward_metadata_capture_cuda_graph(self, *args: Any, **kwargs: Any) -> None:
        pass

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: Any, seq_lens: Any, seq_lens_sum: Any, *args: Any, **kwargs: Any) -> None:
        self.last_replay_view = types.SimpleNamespace(batch_size=bs, seq_lens=seq_lens, seq_lens_sum=seq_lens_sum)

    def init_forward_metadata(self, forward_batch: Any) -> None:
        raise EngineAdapterError("the engine planned attention for an eager forward; engine-check drives graph runners only")

    def forward_extend(self, *args: Any, **kwargs: Any) -> Any:
        raise EngineAdapterError("the engine ran attention; engine-check never runs the model")

    forward_decode = forward_extend


def _attn_backend_class(engine: "Engine") -> type:
    base_mod = importlib.import_module("sglang.srt.layers.attention.base_attn_backend")
    Base = _require(base_mod, "AttentionBackend", engine.version)
    cls = type("EngineCheckAttnBackend", (_AttnRecorder, Base), {"__abstractmethods__": frozenset()})
    return cls


class _FakeGraph:
    """legacy generation: stands in for torch.cuda.CUDAGraph."""

    def __init__(self, handle: "RunnerHandle", bs: int) -> None:
        self.handle, self.bs = handle, bs

    def replay(self) -> None:
        self.handle._on_replay(self.bs)

    def pool(self) -> None:
        return None


class _FakeGraphBackend:
    """runner / prepare generations: stands in for the decode graph backend (capture_one / replay)."""

    def __init__(self, handle: "RunnerHandle") -> None:
        self.handle = handle
        self.outputs: dict[int, Any] = {}

    def capture_one(self, shape_key: Any, run_once: Callable, *args: Any, **kwargs: Any) -> None:
        bs = int(shape_key.size)
        self.handle._run_body_until_model(bs, run_once)
        self.outputs[bs] = self.handle._fake_output(bs)

    def replay(self, shape_key: Any, forward_batch: Any) -> Any:
        bs = int(shape_key.size)
        self.handle._on_replay(bs)
        return self.outputs[bs]

    def can_run(self, forward_batch: Any, key: Any) -> bool:
        size = int(getattr(key, "size", key))
        return size in self.outputs

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise MissingEngineAttribute(f"the engine read its graph backend's {name}, which the adapter's backend does not provide")


class _StopBody(Exception):
    """Raised by the model stand-in: the step body has run up to the model, which is all we need."""


class _ModelProbe:
    """The draft model: never run. Its forward() hands the batch to the runner handle and stops the body."""

    def __init__(self, shared_experts_config: Any = None) -> None:
        self.handle: Optional["RunnerHandle"] = None
        self.shared_experts_config = shared_experts_config  # read by later releases to scope replay

    def forward(self, input_ids: Any, positions: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        if self.handle is None:
            raise EngineAdapterError("the engine ran the draft model outside a capture the adapter drove")
        self.handle._on_model_forward(forward_batch)

    __call__ = forward

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise MissingEngineAttribute(f"the engine read model.{name}, which the adapter's model stand-in does not provide")


# Calls of set_dp_buffer_len made through the runner modules (the step body's DP buffer setup).
_DP_CALLS: list[dict[str, Any]] = []


def _recording_set_dp_buffer_len(real: Callable) -> Callable:
    sig = inspect.signature(real)

    def set_dp_buffer_len(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        _DP_CALLS.append(dict(bound.arguments))
        return real(*args, **kwargs)

    set_dp_buffer_len.__wrapped_engine__ = real  # type: ignore[attr-defined]
    return set_dp_buffer_len


# ----------------------------------------------------------------------------------------
# configuration we drive the engine with
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineConfig:
    """The speculative config and buckets every engine run uses (and our runners' defaults)."""

    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4
    capture_bs: tuple[int, ...] = (1, 2, 4, 8, 16)
    max_running_requests: int = 16
    hidden_size: int = 8
    vocab_size: int = 32


@dataclass
class LiveBatch:
    """One rank's raw batch at replay: sizes per DP group, this rank's lanes."""

    raw_bs: int
    dp_batch_sizes: list[int]
    seq_lens: list[int]
    accept_lens: list[int]


# ----------------------------------------------------------------------------------------
# the loaded engine
# ----------------------------------------------------------------------------------------

_ML_MODULE = "sglang.srt.speculative.multi_layer_eagle_draft_extend_cuda_graph_runner"
_SL_MODULE = "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner"


def _require(obj: Any, name: str, version: str, what: str = "") -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        owner = getattr(obj, "__name__", type(obj).__name__)
        raise EngineAdapterError(
            f"sglang {version}: {owner}.{name} not found{(' (' + what + ')') if what else ''}; "
            f"this release moved it: teach harness/engine_adapter.py where it went"
        ) from None


@dataclass
class Engine:
    version: str
    location: str
    generation: str
    modules: dict[str, types.ModuleType]
    stubbed: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return f"sglang {self.version} ({self.generation} API) from {self.location}"


_LOADED: Optional[Engine] = None


def load(target: Optional[Path], deps: Optional[Path]) -> Engine:
    """Import sglang from `target` (a pip --target dir; None: the environment's), once per process."""
    global _LOADED
    if _LOADED is not None:
        if target is not None and Path(_LOADED.location).resolve() != Path(target).resolve():
            raise EngineAdapterError(f"an engine is already loaded in this process ({_LOADED.describe()}); run one engine per process")
        return _LOADED
    if "sglang" in sys.modules and target is not None:
        raise EngineAdapterError("sglang was imported before the adapter could choose its location")
    if target is not None:
        if not (Path(target) / "sglang").is_dir():
            raise EngineAdapterError(f"no sglang package under {target}")
        sys.path.insert(0, str(target))
    if deps is not None and Path(deps).is_dir():
        sys.path.append(str(deps))  # after site-packages: the interpreter's own copies win
    finder = StubFinder()
    sys.meta_path.insert(0, finder)
    for name in REAL_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise EngineAdapterError(f"the engine adapter needs {name} for real ({e}); run python -m harness.engine_install") from e
    # SGLang logs and warns a lot at import on a CPU box ("only CUDA supports ..."): quiet it.
    logging.getLogger("sglang").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ml = importlib.import_module(_ML_MODULE)
            sl = importlib.import_module(_SL_MODULE)
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] != "sglang":
                raise EngineAdapterError(
                    f"importing the runner modules needs {e.name!r}, which is neither installed nor stubbed: "
                    "add it to STUBBED_MODULES in harness/engine_adapter.py"
                ) from e
            raise EngineAdapterError(f"this sglang has no {e.name} (not an EAGLE draft-extend runner release?)") from e
    import sglang

    location = str(Path(sglang.__file__).resolve().parent.parent)
    version = _version_of(sglang, location)
    mods = {"ml": ml, "sl": sl}
    for key, name in (
        ("server_args", "sglang.srt.server_args"),
        ("fbi", "sglang.srt.model_executor.forward_batch_info"),
        ("logits", "sglang.srt.layers.logits_processor"),
        ("moe_utils", "sglang.srt.layers.moe.utils"),
        ("spec_info", "sglang.srt.speculative.spec_info"),
    ):
        mods[key] = importlib.import_module(name)
    composite = _require(ml, "MultiLayerEagleMultiStepDraftExtendCudaGraphRunner", version)
    runner_cls = _require(ml, "MultiLayerEagleDraftExtendCudaGraphRunner", version)
    mods["parallel_state"] = importlib.import_module("sglang.srt.distributed.parallel_state")
    mods["dp_attention"] = importlib.import_module("sglang.srt.layers.dp_attention")
    if importlib.util.find_spec("sglang.srt.runtime_context") is not None:
        mods["runtime_context"] = importlib.import_module("sglang.srt.runtime_context")
    if hasattr(composite, "prepare"):
        gen = "prepare"
        mods["mle_utils"] = importlib.import_module("sglang.srt.speculative.multi_layer_eagle_utils")
    elif hasattr(runner_cls, "capture_one_shape") and hasattr(runner_cls, "execute"):
        gen = "runner"
    elif hasattr(runner_cls, "capture_one_batch_size") and hasattr(runner_cls, "replay"):
        gen = "legacy"
    else:
        raise EngineAdapterError(
            f"sglang {version}: MultiLayerEagleDraftExtendCudaGraphRunner has neither capture_one_batch_size/replay (legacy), "
            "capture_one_shape/execute (runner) nor a composite prepare() (prepare): a new runner API"
        )
    _LOADED = Engine(version, location, gen, mods, sorted(finder.served))
    _install_module_shims(_LOADED)
    return _LOADED


def _install_module_shims(engine: Engine) -> None:
    """Process-wide swaps in the runner modules (engine-check runs one engine per process)."""
    ml, sl = engine.modules["ml"], engine.modules["sl"]
    # get_available_gpu_memory: only logged around each capture; needs a device
    ml.get_available_gpu_memory = lambda *a, **k: 0.0
    # set_dp_buffer_len: recorded (and still run) so the capture-time DP buffer setup is visible
    for mod in (ml, sl):
        real = _require(mod, "set_dp_buffer_len", engine.version, "the step body's DP buffer setup")
        mod.set_dp_buffer_len = _recording_set_dp_buffer_len(real)
    # flashinfer autotuning runs the step body (the model) before capture: nothing to tune here
    for mod in (ml, sl):
        if hasattr(mod, "maybe_flashinfer_autotune_speculative_draft"):
            mod.maybe_flashinfer_autotune_speculative_draft = _noop
    if engine.generation == "prepare":
        # prepare()'s fused fill is a Triton kernel that needs a GPU; the module ships its native twin
        native = _require(engine.modules["mle_utils"], "fill_draft_extend_prepare_buffers_native", engine.version,
                          "the native twin of the fused prepare() fill kernel")
        _require(ml, "fill_draft_extend_prepare_buffers", engine.version, "the fill kernel prepare() calls")
        ml.fill_draft_extend_prepare_buffers = native


def _version_of(sglang: types.ModuleType, location: str) -> str:
    for dist in Path(location).glob("sglang-*.dist-info"):
        return dist.name[len("sglang-"):-len(".dist-info")]
    v = getattr(sglang, "__version__", None)
    if isinstance(v, str):
        return v
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ----------------------------------------------------------------------------------------
# per-layout configuration of the engine's process state
# ----------------------------------------------------------------------------------------


def _server_args(engine: Engine, layout: ParallelLayout, cfg: EngineConfig) -> Any:
    sa_mod = engine.modules["server_args"]
    ServerArgs = _require(sa_mod, "ServerArgs", engine.version)
    # a dataclass up to 0.5.2x, a msgspec Struct later: both have a real signature
    names = set(inspect.signature(ServerArgs).parameters)
    kwargs: dict[str, Any] = dict(
        model_path="dummy",  # "dummy" short-circuits ServerArgs.__post_init__'s model and hardware probing
        device="cpu",
        tp_size=layout.tp_size,
        dp_size=layout.dp_size,
        enable_dp_attention=layout.enable_dp_attention,
        moe_dense_tp_size=layout.moe_dense_tp_size,
        enable_dp_lm_head=layout.enable_dp_lm_head,
        moe_a2a_backend=layout.moe_a2a_backend,
        enable_two_batch_overlap=layout.enable_two_batch_overlap,
        speculative_algorithm="EAGLE",
        speculative_num_steps=cfg.num_steps,
        speculative_eagle_topk=cfg.topk,
        speculative_num_draft_tokens=cfg.num_draft_tokens,
        max_running_requests=cfg.max_running_requests,
    )
    if "cuda_graph_bs" in names:
        kwargs["cuda_graph_bs"] = list(cfg.capture_bs)
    else:
        cgc = importlib.import_module("sglang.srt.model_executor.cuda_graph_config")
        Config, Phase = _require(cgc, "CudaGraphConfig", engine.version), _require(cgc, "PhaseConfig", engine.version)
        base = _require(cgc, "default_cuda_graph_config", engine.version)()
        kwargs["cuda_graph_config"] = Config(
            decode=Phase(backend="full", max_bs=max(cfg.capture_bs), bs=list(cfg.capture_bs)), prefill=base.prefill
        )
    missing = [k for k in kwargs if k not in names]
    if missing:
        raise EngineAdapterError(f"sglang {engine.version}: ServerArgs has no field(s) {missing}; the adapter sets them to describe the layout")
    return ServerArgs(**kwargs)


def _configure_process(engine: Engine, sa: Any, layout: ParallelLayout, tp_rank: int) -> None:
    """Make the engine's process-wide state describe `layout` as seen from `tp_rank`.

    By feature, not by version: releases with a runtime context get the server args
    published into it (with the rank bundle where publish() takes one: the topology then
    lives in the context); the others get set_global_server_args_for_scheduler. Where the
    topology is still read through parallel_state / dp_attention, those globals get fake
    groups of the right sizes and ranks.
    """
    attn_tp, attn_dp = layout.attn_tp_size, layout.attn_dp_size
    attn_tp_rank, attn_dp_rank = layout.attn_tp_rank(tp_rank), layout.attn_dp_rank(tp_rank)
    sa_mod, moe = engine.modules["server_args"], engine.modules["moe_utils"]
    rc = engine.modules.get("runtime_context")
    publish = getattr(rc, "publish", None) if rc is not None else None
    ranks_in_context = publish is not None and "ranks" in inspect.signature(publish).parameters
    if publish is not None:
        parallel = rc.get_parallel()
        if hasattr(parallel, "clear_stamp"):
            parallel.clear_stamp()  # each (layout, rank) re-publishes: drop the previous one's stamped ranks
        if ranks_in_context:
            publish(sa, role="scheduler", ranks=_require(rc, "SpawnRanks", engine.version)(world_rank=tp_rank))
        else:
            publish(sa, role="scheduler")
    else:
        _require(sa_mod, "set_global_server_args_for_scheduler", engine.version)(sa)
    if not ranks_in_context:
        ps, dpa = engine.modules["parallel_state"], engine.modules["dp_attention"]
        groups = {"_TP": _FakeGroup("tp", layout.tp_size, tp_rank), "_ATTN_TP": _FakeGroup("attn_tp", attn_tp, attn_tp_rank),
                  "_ATTN_CP": _FakeGroup("attn_cp", 1, 0)}
        for name, group in groups.items():
            _require(ps, name, engine.version, "a parallel_state group global")
            setattr(ps, name, group)
        for name, value in (("_ATTN_DP_RANK", attn_dp_rank), ("_ATTN_DP_SIZE", attn_dp)):
            _require(dpa, name, engine.version, "a dp_attention global")
            setattr(dpa, name, value)
        # present up to 0.5.1x only (later releases derive them from the published config)
        for name, value in (("_LOCAL_ATTN_DP_RANK", attn_dp_rank), ("_LOCAL_ATTN_DP_SIZE", attn_dp),
                            ("_ENABLE_DP_ATTENTION_FLAG", layout.enable_dp_attention)):
            if hasattr(dpa, name):
                setattr(dpa, name, value)
    # the MoE a2a backend (read by require_*_gather): seeded from the server args, or from the published context
    init_moe = _require(moe, "initialize_moe_config", engine.version, "seeds the MoE a2a backend")
    init_moe(sa) if inspect.signature(init_moe).parameters else init_moe()
    if rc is not None and ranks_in_context:
        par = rc.get_parallel()
        got = (par.attn_tp_size, par.num_dp_ranks if layout.enable_dp_attention else 1)
        if got != (attn_tp, attn_dp):
            raise EngineAdapterError(f"sglang {engine.version}: published layout {layout.describe()} reads back attn_tp/dp {got}, expected {(attn_tp, attn_dp)}")


# ----------------------------------------------------------------------------------------
# runner handles: build, capture, replay, convert
# ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any, version: str, why: str) -> Iterator[None]:
    old = _require(obj, name, version, why)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


class RunnerHandle:
    """One engine graph runner (a multi-layer step or the single-layer runner) and what it baked."""

    def __init__(self, engine: Engine, kind: str, step: int, runner: Any, attn: _AttnRecorder, layout: ParallelLayout, cfg: EngineConfig) -> None:
        self.engine, self.kind, self.step, self.runner, self.attn, self.layout, self.cfg = engine, kind, step, runner, attn, layout, cfg
        self.captures: dict[int, CaptureRecord] = {}
        self._batches: dict[int, Any] = {}  # bs -> the capture-time forward batch the model was called with
        self.capture_rows: dict[int, tuple[int, int]] = {}  # bs -> (rows fed to lm_head, logits rows)
        self.snapshots: list[_Snapshot] = []

    # ---- what the engine derived ----
    @property
    def tokens_per_bs(self) -> int:
        r = self.runner
        for name in ("captured_req_width", "num_tokens_per_bs"):
            if name in vars(r):
                return int(vars(r)[name])
        raise EngineAdapterError(f"sglang {self.engine.version}: {type(r).__name__} has neither captured_req_width nor num_tokens_per_bs")

    @property
    def capture_bs(self) -> list[int]:
        return [int(b) for b in self.runner.capture_bs]

    @property
    def engine_branch(self) -> str:
        r = self.runner
        if r.require_mlp_tp_gather:
            return Branch.MLP_TP_GATHER.value
        if r.require_attn_tp_gather:
            return Branch.ATTN_TP_GATHER.value
        return Branch.NEITHER.value

    def _buffers(self) -> Any:
        return self.runner.buffers

    # ---- capture ----
    def _fake_output(self, bs: int) -> Any:
        """What the graph's output buffers would hold: the batch's logits buffer, hidden states, top-k."""
        fb = self._batches.get(bs)
        LPO = self.engine.modules["logits"].LogitsProcessorOutput
        n = bs * self.tokens_per_bs
        logits = fb.next_token_logits_buffer if fb is not None and fb.next_token_logits_buffer is not None else torch.zeros(n, self.cfg.vocab_size)
        out = LPO(next_token_logits=logits, hidden_states=torch.zeros(n, self.cfg.hidden_size))
        out.topk_p = torch.ones(bs, self.cfg.topk)
        out.topk_index = torch.zeros(bs, self.cfg.topk, dtype=torch.int64)
        return out

    def _run_body_until_model(self, bs: int, run_once: Callable) -> None:
        """Run the captured step body (the warm-up) up to the model call, then stop it there.

        The prefix is the engine's own: it clears the DP-local scratch, sets the DP buffer
        (set_dp_buffer_len: the token counts DP attention will gather with) and calls the
        model with the capture-time batch. The model stand-in records the batch, the DP
        buffer it was given and the rows the logits processor would feed lm_head, and stops.
        """
        self._body = None
        _DP_CALLS.clear()
        try:
            run_once()
        except _StopBody:
            pass
        if self._body is None:
            raise EngineAdapterError(f"sglang {self.engine.version}: the {self.kind} runner's capture body for bucket {bs} never called the model")
        self._record_capture(bs)

    def _on_model_forward(self, fb: Any) -> None:
        """The body called the model: the batch, the DP buffer and the gathered gpu tensors are what the graph bakes."""
        if not _DP_CALLS:
            raise EngineAdapterError(f"sglang {self.engine.version}: the {self.kind} step body called the model without set_dp_buffer_len")
        buf = self._buffers()
        self._body = (fb, dict(_DP_CALLS[-1]), _tolist(buf.global_num_tokens_gpu), _tolist(buf.global_num_tokens_for_logprob_gpu))
        raise _StopBody

    def _record_capture(self, bs: int) -> None:
        fb, dp, gpu_tokens, gpu_logprob = self._body
        if int(fb.batch_size) != bs:
            raise EngineAdapterError(f"sglang {self.engine.version}: capturing bucket {bs} of the {self.kind} runner ran the model on a batch of {fb.batch_size}")
        self._batches[bs] = fb
        def ints(x: Any) -> Optional[list[int]]:
            return None if x is None else [int(v) for v in x]
        body_tokens = ints(dp.get("global_num_tokens"))
        host = {
            "forward_mode": getattr(fb.forward_mode, "name", str(fb.forward_mode)).lower(),
            "batch_size": int(fb.batch_size),
            "num_tokens": int(fb.input_ids.shape[0]),
            "extend_num_tokens": fb.extend_num_tokens,
            # the host token counts: the step body's set_dp_buffer_len(...) (what DP attention gathers with), else the batch's
            "global_num_tokens_cpu": body_tokens if body_tokens is not None else ints(fb.global_num_tokens_cpu),
            "global_num_tokens_for_logprob_cpu": ints(fb.global_num_tokens_for_logprob_cpu),
            "global_dp_buffer_len": dp.get("global_dp_buffer_len"),
            "dp_padding_mode": "max_len" if dp.get("dp_max_padding") else "sum_len",
            # the same values as carried on the forward batch itself (None where the engine leaves them off)
            "fb_global_num_tokens_cpu": ints(fb.global_num_tokens_cpu),
            "fb_global_dp_buffer_len": fb.global_dp_buffer_len,
            "local_dp_buffer_len": dp.get("local_dp_buffer_len"),
        }
        self.captures[bs] = CaptureRecord(bs, int(fb.input_ids.shape[0]), host, gpu_tokens, gpu_logprob)
        self.capture_rows[bs] = (self._rows_fed_to_lm_head(fb), int(fb.next_token_logits_buffer.shape[0]))

    def _rows_fed_to_lm_head(self, fb: Any) -> int:
        """Rows the engine's logits processor would give lm_head for this batch: its own row selection."""
        lp = self.engine.modules["logits"]
        meta = lp.LogitsMetadata.from_forward_batch(fb)
        hidden = torch.zeros(int(fb.input_ids.shape[0]), 1)
        pruned = lp.LogitsProcessor._get_pruned_states(_Strict("LogitsProcessor"), hidden, None, None, meta)[0]
        return int(pruned.shape[0])

    def capture_all(self) -> None:
        """Every bucket, largest first, through the engine's capture path, stopping before the graph."""
        r, gen = self.runner, self.engine.generation
        for bs in reversed(self.capture_bs):
            if gen == "legacy":
                self._capturing_bs = bs
                graph, out = r.capture_one_batch_size(bs, None)
                r.graphs[bs] = graph
                r.output_buffers[bs] = out
            else:
                r.capture_one_shape(bs, None)
            if bs not in self.captures:
                raise EngineAdapterError(f"sglang {self.engine.version}: capturing bucket {bs} of the {self.kind} runner recorded nothing")

    def install_graph_stand_ins(self) -> None:
        r, handle = self.runner, self
        if self.engine.generation == "legacy":
            # CudaGraphRunner-era hooks: a graph object, the two warm-ups, the capture itself
            def capture_init(run_once: Callable) -> None:
                handle._run_body_until_model(handle._capturing_bs, run_once)

            def capture_graph(graph: Any, pool: Any, stream: Any, run_once: Callable) -> Any:
                return handle._fake_output(handle._capturing_bs)

            vars(r).update(graphs={}, output_buffers={}, stream=None, _capture_init=capture_init, _capture_graph=capture_graph,
                           _create_graph=lambda: _FakeGraph(handle, handle._capturing_bs))
        else:
            r.backend = _FakeGraphBackend(self)
        model = r.model_runner.model
        if not isinstance(model, _ModelProbe):
            raise EngineAdapterError(f"sglang {self.engine.version}: the {self.kind} runner's model_runner is not the adapter's")
        model.handle = self

    # ---- replay ----
    def _on_replay(self, bs: int) -> None:
        buf = self._buffers()
        g = buf.global_num_tokens_gpu
        self.snapshots.append(_Snapshot(bs, _tolist(g), _tolist(buf.global_num_tokens_for_logprob_gpu),
                                        None if g is None else tuple(g.shape), [int(x) for x in buf.seq_lens[:bs].tolist()]))

    def record(self, live: LiveBatch, returned_rows: Optional[int]) -> tuple[ReplayRecord, Optional[int]]:
        """Turn the last replay's snapshot into our ReplayRecord (plus the rows the engine handed back)."""
        if not self.snapshots:
            raise EngineAdapterError(f"sglang {self.engine.version}: the {self.kind} runner's replay never reached the graph")
        snap = self.snapshots[-1]
        view = self.attn.last_replay_view
        seq_lens_sum = None if view is None else view.seq_lens_sum
        cap = self.captures.get(snap.bs)
        if cap is None:
            raise EngineAdapterError(f"sglang {self.engine.version}: replay chose bucket {snap.bs}, which was never captured")
        rows_fed, logits_rows = self.capture_rows[snap.bs]
        rec = ReplayRecord(
            runner=self.kind, step=self.step, branch=self.layout.branch.value, raw_bs=live.raw_bs, bs=snap.bs,
            tokens_per_bs=self.tokens_per_bs, capture=cap, global_num_tokens_gpu=snap.global_num_tokens_gpu,
            global_num_tokens_for_logprob_gpu=snap.global_num_tokens_for_logprob_gpu, gpu_shape=snap.gpu_shape,
            padded_seq_lens=snap.seq_lens[live.raw_bs:], seq_lens_sum=seq_lens_sum if seq_lens_sum is None else int(seq_lens_sum),
            seq_lens_sum_actual=sum(snap.seq_lens), rows_fed=rows_fed, logits_rows=logits_rows, captured_bs=self.capture_bs,
        )
        self.attn.last_replay_view = None
        return rec, returned_rows


class EngineRunners:
    """All draft-extend graph runners of one rank of one layout: multi-layer steps + single-layer."""

    def __init__(self, engine: Engine, layout: ParallelLayout, tp_rank: int, cfg: EngineConfig = EngineConfig()) -> None:
        self.engine, self.layout, self.tp_rank, self.cfg = engine, layout, tp_rank, cfg
        sa = _server_args(engine, layout, cfg)
        _configure_process(engine, sa, layout, tp_rank)
        self.server_args = sa
        self._attn_cls = _attn_backend_class(engine)
        self.multi = self._build_multi_layer(sa)
        self.single = self._build_single_layer(sa)

    # ---- stand-ins ----
    def _model_runner(self, sa: Any, attn: _AttnRecorder) -> _Strict:
        cfg = self.cfg
        spec_alg = self.engine.modules["spec_info"].SpeculativeAlgorithm
        hf_config = _Strict("model_config.hf_config")
        model_config = _Strict("model_config", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, spec_hidden_size=cfg.hidden_size,
                               dtype=torch.float32, hf_config=hf_config, model_is_mrope=False, is_multimodal=False)
        return _Strict(
            "model_runner", server_args=sa, device="cpu", gpu_id=0, tp_size=self.layout.tp_size, dp_size=self.layout.dp_size,
            tp_rank=self.tp_rank, model_config=model_config, spec_algorithm=spec_alg.from_string("EAGLE"),
            req_to_token_pool=_Strict("req_to_token_pool", size=cfg.max_running_requests), token_to_kv_pool=_Strict("token_to_kv_pool"),
            attn_backend=attn,
            canary_manager=None, device_timer=None, tp_group=_FakeGroup("tp", self.layout.tp_size, self.tp_rank),
            kv_index_translator=_Strict("kv_index_translator", bind_runner_slots=_noop),
            graph_shared_output=_Strict("graph_shared_output", get_logits_buffer=lambda vocab, rows: torch.zeros(rows, vocab)),
            model=self._model_stand_in(), model_context=contextlib.nullcontext, war_fastpath_read_done_event=None,
            ps=self._parallel_sizes(),
        )

    def _parallel_sizes(self) -> _Strict:
        """model_runner.ps of 0.5.1x-0.5.2x: the rank's parallel sizes and ranks."""
        lay, r = self.layout, self.tp_rank
        return _Strict("model_runner.ps", tp_size=lay.tp_size, tp_rank=r, attn_tp_size=lay.attn_tp_size, attn_tp_rank=lay.attn_tp_rank(r),
                       attn_dp_size=lay.attn_dp_size, attn_dp_rank=lay.attn_dp_rank(r), attn_cp_size=1, attn_cp_rank=0, pp_size=1, pp_rank=0,
                       attn_dcp_size=1, dcp_size=1, moe_ep_size=1, moe_tp_size=lay.tp_size, moe_dp_size=1)

    def _model_stand_in(self) -> _ModelProbe:
        """Later releases read the model's shared-experts layout to scope replay: keep the published one."""
        shared = None
        rc = self.engine.modules.get("runtime_context")
        if rc is not None and hasattr(rc, "get_model"):
            shared = getattr(rc.get_model(), "shared_experts", None)
        return _ModelProbe(shared)

    def _worker(self, sa: Any, backends: list[_AttnRecorder], runners: list[_Strict]) -> _Strict:
        cfg = self.cfg
        return _Strict(
            "eagle_worker", server_args=sa, device="cpu", gpu_id=0, speculative_num_steps=cfg.num_steps,
            speculative_num_draft_tokens=cfg.num_draft_tokens, topk=cfg.topk, draft_extend_attn_backend_list=backends,
            draft_extend_attn_backend=backends[0], mtp_model_runner=lambda step: runners[step], draft_runner=runners[0],
            draft_runner_list=runners, chain_mtp_hidden_states=False, hidden_size=cfg.hidden_size,
            speculative_algorithm=runners[0].spec_algorithm, hot_token_id=None, draft_extend_num_front_tokens=0,
            use_rejection_sampling=False, seed_dsa_topk_from_draft_extend=False, req_to_hidden_states_pool=None,
            model_config=runners[0].model_config, eagle_use_aux_hidden_state=False,
            target_worker=_Strict("target_worker", model_runner=runners[0]),
        )

    # ---- building ----
    def _build_multi_layer(self, sa: Any) -> list[RunnerHandle]:
        eng, ml = self.engine, self.engine.modules["ml"]
        backends = [self._attn_cls() for _ in range(self.cfg.num_steps)]
        mrs = [self._model_runner(sa, b) for b in backends]
        worker = self._worker(sa, backends, mrs)
        Composite = ml.MultiLayerEagleMultiStepDraftExtendCudaGraphRunner
        Runner = ml.MultiLayerEagleDraftExtendCudaGraphRunner
        comp = object.__new__(Composite)
        if eng.generation == "prepare":
            # __init__'s fields, then _init_and_capture with the graph capture left out
            vars(comp).update(eagle_worker=worker, device="cpu", gpu_id=0, speculative_num_steps=self.cfg.num_steps,
                              draft_extend_attn_backend_list=backends, runners=[], seq_len_fill_value=1, max_bs=1,
                              captured_req_width=1, num_front_tokens=0, prune_draft_extend_logits=False,
                              _out_cache_loc_virtual=None, _kv_loc_plan=None, _kv_loc_cols=None)
        else:
            vars(comp).update(eagle_worker=worker, device="cpu", gpu_id=0, speculative_num_steps=self.cfg.num_steps,
                              draft_extend_attn_backend_list=backends, runners=[], cuda_graph_buffers={}, seq_len_fill_value=1,
                              max_bs=1, offsets=[0])
        stack = contextlib.ExitStack()
        with stack:
            stack.enter_context(_patched(Runner, "capture", _noop, eng.version, "the graph capture loop, left out"))
            if eng.generation != "legacy":
                stack.enter_context(_patched(ml, "resolve_decode_backend", lambda runner: None, eng.version, "the graph backend"))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                comp._init_and_capture()
        self.composite = comp
        handles = []
        for step, runner in enumerate(comp.runners):
            if runner is None:
                raise EngineAdapterError(f"sglang {eng.version}: the composite built no runner for step {step}")
            h = RunnerHandle(eng, "multi_layer", step, runner, backends[step], self.layout, self.cfg)
            h.install_graph_stand_ins()
            handles.append(h)
        for h in reversed(handles):  # the engine captures the last step first
            h.capture_all()
        return handles

    def _build_single_layer(self, sa: Any) -> RunnerHandle:
        eng, sl = self.engine, self.engine.modules["sl"]
        attn = self._attn_cls()
        mr = self._model_runner(sa, attn)
        worker = self._worker(sa, [attn], [mr])
        Runner = sl.EAGLEDraftExtendCudaGraphRunner
        runner = object.__new__(Runner)
        # __init__ ends by capturing: leave that out (per instance), and give the graph backend a stand-in
        vars(runner)["capture"] = _noop
        with contextlib.ExitStack() as stack:
            if eng.generation != "legacy":
                stack.enter_context(_patched(sl, "resolve_decode_backend", lambda r: None, eng.version, "the graph backend"))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                Runner.__init__(runner, worker)
        del vars(runner)["capture"]
        h = RunnerHandle(eng, "single_layer", 0, runner, attn, self.layout, self.cfg)
        h.install_graph_stand_ins()
        h.capture_all()
        return h

    @property
    def handles(self) -> list[RunnerHandle]:
        return [*self.multi, self.single]

    # ---- live batches ----
    def _forward_batch(self, live: LiveBatch, T: int) -> Any:
        fbi = self.engine.modules["fbi"]
        raw, n = live.raw_bs, live.raw_bs * T
        seq_lens = torch.tensor(live.seq_lens, dtype=torch.int64)
        accept = torch.tensor(live.accept_lens, dtype=torch.int32)
        spec = types.SimpleNamespace(
            hidden_states=torch.zeros(n, self.cfg.hidden_size), num_correct_drafts=accept - 1, num_accept_tokens=accept,
            num_tokens_per_req=T, num_tokens_for_logprob_per_req=1, positions=None, select_index=None,
            extend_seq_lens_cpu=None, extend_seq_lens_tensor=None,
        )
        dp_sizes = list(live.dp_batch_sizes)
        fb = fbi.ForwardBatch(
            forward_mode=fbi.ForwardMode.DRAFT_EXTEND_V2, batch_size=raw, input_ids=torch.arange(n, dtype=torch.int64) + 3,
            req_pool_indices=torch.arange(1, raw + 1, dtype=torch.int64), seq_lens=seq_lens, out_cache_loc=torch.arange(n, dtype=torch.int64) + 7,
            seq_lens_sum=int(seq_lens.sum()),
        )
        extra = dict(
            seq_lens_cpu=seq_lens.clone(), positions=torch.zeros(n, dtype=torch.int64), spec_info=spec,
            extend_seq_lens=torch.full((raw,), T, dtype=torch.int32), extend_start_loc=torch.arange(raw, dtype=torch.int32) * T,
            extend_seq_lens_cpu=[T] * raw, extend_num_tokens=n,
            original_global_num_tokens_cpu=dp_sizes, global_num_tokens_cpu=[b * T for b in dp_sizes],
            global_num_tokens_for_logprob_cpu=[b * T for b in dp_sizes],
            can_run_dp_cuda_graph=True, can_run_decode_cuda_graph=True,
        )
        for k, v in extra.items():
            setattr(fb, k, v)
        return fb

    def replay_multi_layer(self, live: LiveBatch) -> list[tuple[ReplayRecord, Optional[int]]]:
        """One decode iteration of the multi-layer draft-extend, as the worker drives it."""
        eng, comp = self.engine, self.composite
        T0 = self.multi[0].tokens_per_bs
        fb = self._forward_batch(live, T0)
        out = []
        if eng.generation == "prepare":
            if not comp.can_run_graph(fb):
                raise EngineAdapterError(f"sglang {eng.version}: the multi-layer composite refused a batch of {live.raw_bs} (can_run_graph)")
            if "staged" in inspect.signature(comp.prepare).parameters:
                comp.prepare(fb, staged=False)  # staged: a path where the worker stages shared reads first
            else:
                comp.prepare(fb)
            for step, h in enumerate(self.multi):
                logits, _p, _i = comp.replay(step)
                out.append(h.record(live, int(logits.next_token_logits.shape[0])))
            return out
        can_run = comp.can_run(fb) if eng.generation == "legacy" else comp.can_run_graph(fb)
        if not can_run:
            raise EngineAdapterError(f"sglang {eng.version}: the multi-layer composite refused a batch of {live.raw_bs} (can_run)")
        result = types.SimpleNamespace(accept_lens=fb.spec_info.num_accept_tokens.clone())
        comp.reset_buffers(fb, result)
        for step, h in enumerate(self.multi):
            run = h.runner.replay if eng.generation == "legacy" else h.runner.execute
            res = run(fb, init_state=(step == 0))
            out.append(h.record(live, int(res.next_token_logits.shape[0])))
        return out

    def replay_single_layer(self, live: LiveBatch) -> tuple[ReplayRecord, Optional[int]]:
        eng, h = self.engine, self.single
        T = h.tokens_per_bs
        fb = self._forward_batch(live, T)
        r = h.runner
        can_run = r.can_run(fb) if eng.generation == "legacy" else r.can_run_graph(fb)
        if not can_run:
            raise EngineAdapterError(f"sglang {eng.version}: the single-layer runner refused a batch of {live.raw_bs} (can_run)")
        if eng.generation == "legacy":
            res = r.replay(fb)
        elif "select_index" in inspect.signature(r.execute).parameters:
            # later releases hand the worker's select_index (each request's last accepted row) to execute
            accept = fb.spec_info.num_accept_tokens.to(torch.int64)
            select_index = torch.arange(live.raw_bs, dtype=torch.int64) * T + accept - 1
            res = r.execute(fb, select_index)
        else:
            res = r.execute(fb)
        return h.record(live, int(res.next_token_logits.shape[0]))
