"""The engine adapter: drive an installed SGLang's EAGLE draft-extend graph runners on a CPU.

`harness engine-check` points our P1 invariants at the engine's own code. SGLang's runner
modules are plain Python; what they compute on the host -- the forward batch that
`get_forward_batch(bs)` / the capture path bakes per bucket, what replay / prepare fills in,
the bucket it picks -- is exactly where the seed bug lived. This module is the only place
that knows SGLang: every stub, shim and patch lives here, is documented here, and is keyed
to the API generation it serves. harness/engine_check.py sees only our own records
(runners.cuda_graph.CaptureRecord / ReplayRecord).

What is real and what is not
----------------------------
Real: the runner classes and their __init__, the multi-step composite that owns the shared
buffers, get_batch_sizes_to_capture, require_*_gather, ServerArgs / the runtime context,
ForwardBatch, the capture path up to the graph, replay / prepare up to the graph, and the
logits processor's own row selection (LogitsProcessor._get_pruned_states), which says how
many rows a captured batch feeds to lm_head.

Not real, each for a stated reason:
  * third-party imports (STUBBED_MODULES): a meta-path finder serves package-like stub
    modules whose attributes are real, subclassable classes (and whose instances absorb
    calls and attribute reads). Only the names listed are stubbed, always, even where the
    host has them installed, so a check does not depend on what else the machine has;
    anything else missing raises ImportError as usual (SGLang probes optional kernels with
    try/except ImportError and must keep seeing them absent). REAL_MODULES are imported
    for real (the runner modules use them at import time: msgspec structs, triton.jit, ...).
  * the model, the worker and the model runner: strict stand-ins (`_Strict`) that carry the
    attributes the runner code reads. Reading one they do not carry raises
    MissingEngineAttribute naming the owner and the attribute, so a release that moves
    something fails with a message saying what it now reads.
  * the attention backend: records the forward batch it is asked to plan (at capture) and
    the seq_lens_sum it is given (at replay); get_cuda_graph_seq_len_fill_value() is 1, as
    our runners use (runners.draft_extend.SEQ_LEN_FILL_VALUE).
  * the CUDA graph: capture builds the batch and plans attention exactly as the engine
    does, then stops before the graph (no step body runs: it needs the model and GPU
    kernels). Replay runs the engine's replay / prepare code and, where it would launch the
    graph, snapshots the static buffers the graph would read.
  * parallel groups: a fake group per axis (world_size / rank_in_group), set where the
    release reads them (parallel_state globals up to 0.5.14, the published runtime context
    from the prepare() generation on).
  * the fused prepare() fill kernel of the prepare() generation is Triton on a GPU; the
    module ships fill_draft_extend_prepare_buffers_native ("mirrors the triton kernel's
    semantics exactly", its docstring says), which is swapped in.
  * between multi-layer steps the engine advances the chain inside the graph
    (assign_new_state / rotate_input_ids, GPU kernels): not run. Metadata of steps > 0 is
    therefore read with step 0's token buffers, which does not change any value checked.

API generations (detected from the classes, not from the version string):
  legacy  (0.5.12.post1, 0.5.13.post1): runners own `graphs` / `output_buffers`; capture
          is `capture_one_batch_size`; replay is `replay(forward_batch, init_state)`;
          per-step widths num_steps + 1 + step; require_*(server_args).
  runner  (0.5.14 ..): runners subclass DecodeCudaGraphRunner with a graph backend
          (`resolve_decode_backend`); capture is `capture_one_shape`; replay is `execute`.
  prepare (by 0.5.23): the composite owns one buffer set and one width for all steps;
          `prepare(forward_batch)` fills it with a fused kernel and `replay(step)` replays;
          logits are pruned to one row per request when no gathered buffer is needed;
          configuration is published into a runtime context (require_*() take no args).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
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
    "openai", "orjson", "partial_json_parser", "PIL", "psutil", "pybase64", "pydantic",
    "pydantic_core", "requests", "safetensors", "sentencepiece", "setproctitle", "starlette",
    "torchao", "torchvision", "tqdm", "transformers", "tvm_ffi", "uvicorn", "uvloop", "zmq",
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


class _AttnBackend:
    """Stand-in attention backend: plans nothing, records what it is asked to plan."""

    def __init__(self, owner: "RunnerHandle | None" = None) -> None:
        self.owner = owner
        self.captured: dict[int, Any] = {}  # bs -> forward batch planned at capture
        self.last_replay_view: Any = None

    # read by the runners' __init__
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        pass

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def draft_extend_metadata_captured_in_graph(self) -> bool:
        return False

    supports_draft_extend_metadata_staging = False

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        if in_capture:
            self.captured[int(forward_batch.batch_size)] = forward_batch
            if self.owner is not None:
                self.owner._on_capture_plan(forward_batch)
        else:
            self.last_replay_view = forward_batch

    def init_forward_metadata_in_graph(self, forward_batch: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise MissingEngineAttribute(f"the engine read attn_backend.{name}, which the adapter's attention backend does not provide")


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
    if hasattr(composite, "prepare"):
        gen = "prepare"
        mods["runtime_context"] = importlib.import_module("sglang.srt.runtime_context")
        mods["mle_utils"] = importlib.import_module("sglang.srt.speculative.multi_layer_eagle_utils")
    elif hasattr(runner_cls, "capture_one_shape") and hasattr(runner_cls, "execute"):
        gen = "runner"
        mods["parallel_state"] = importlib.import_module("sglang.srt.distributed.parallel_state")
        mods["dp_attention"] = importlib.import_module("sglang.srt.layers.dp_attention")
    elif hasattr(runner_cls, "capture_one_batch_size") and hasattr(runner_cls, "replay"):
        gen = "legacy"
        mods["parallel_state"] = importlib.import_module("sglang.srt.distributed.parallel_state")
        mods["dp_attention"] = importlib.import_module("sglang.srt.layers.dp_attention")
    else:
        raise EngineAdapterError(
            f"sglang {version}: MultiLayerEagleDraftExtendCudaGraphRunner has neither capture_one_batch_size/replay (legacy), "
            "capture_one_shape/execute (runner) nor a composite prepare() (prepare): a new runner API"
        )
    _LOADED = Engine(version, location, gen, mods, sorted(finder.served))
    return _LOADED


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
    """Make the engine's process-wide state describe `layout` as seen from `tp_rank`."""
    attn_tp, attn_dp = layout.attn_tp_size, layout.attn_dp_size
    attn_tp_rank, attn_dp_rank = layout.attn_tp_rank(tp_rank), layout.attn_dp_rank(tp_rank)
    sa_mod, moe = engine.modules["server_args"], engine.modules["moe_utils"]
    if engine.generation == "prepare":
        rc = engine.modules["runtime_context"]
        publish, SpawnRanks = _require(rc, "publish", engine.version), _require(rc, "SpawnRanks", engine.version)
        publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=tp_rank))
        got = (rc.get_parallel().attn_tp_size, rc.get_parallel().num_dp_ranks if layout.enable_dp_attention else 1)
        if got != (attn_tp, attn_dp):
            raise EngineAdapterError(f"sglang {engine.version}: published layout {layout.describe()} reads back attn_tp/dp {got}, expected {(attn_tp, attn_dp)}")
    else:
        _require(sa_mod, "set_global_server_args_for_scheduler", engine.version)(sa)
        ps, dpa = engine.modules["parallel_state"], engine.modules["dp_attention"]
        groups = {"_TP": _FakeGroup("tp", layout.tp_size, tp_rank), "_ATTN_TP": _FakeGroup("attn_tp", attn_tp, attn_tp_rank),
                  "_ATTN_CP": _FakeGroup("attn_cp", 1, 0)}
        for name, group in groups.items():
            _require(ps, name, engine.version, "a parallel_state group global")
            setattr(ps, name, group)
        for name, value in (("_ATTN_DP_RANK", attn_dp_rank), ("_ATTN_DP_SIZE", attn_dp), ("_LOCAL_ATTN_DP_RANK", attn_dp_rank),
                            ("_LOCAL_ATTN_DP_SIZE", attn_dp), ("_ENABLE_DP_ATTENTION_FLAG", layout.enable_dp_attention)):
            _require(dpa, name, engine.version, "a dp_attention global")
            setattr(dpa, name, value)
    # the MoE a2a backend (read by require_*_gather): from the server args up to 0.5.2x, from the published context later
    init_moe = _require(moe, "initialize_moe_config", engine.version, "seeds the MoE a2a backend")
    init_moe() if engine.generation == "prepare" else init_moe(sa)


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

    def __init__(self, engine: Engine, kind: str, step: int, runner: Any, attn: _AttnBackend, layout: ParallelLayout, cfg: EngineConfig) -> None:
        self.engine, self.kind, self.step, self.runner, self.attn, self.layout, self.cfg = engine, kind, step, runner, attn, layout, cfg
        attn.owner = self
        self.captures: dict[int, CaptureRecord] = {}
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
        fb = self.attn.captured.get(bs)
        LPO = self.engine.modules["logits"].LogitsProcessorOutput
        n = bs * self.tokens_per_bs
        logits = fb.next_token_logits_buffer if fb is not None and fb.next_token_logits_buffer is not None else torch.zeros(n, self.cfg.vocab_size)
        out = LPO(next_token_logits=logits, hidden_states=torch.zeros(n, self.cfg.hidden_size))
        out.topk_p = torch.ones(bs, self.cfg.topk)
        out.topk_index = torch.zeros(bs, self.cfg.topk, dtype=torch.int64)
        return out

    def _on_capture_plan(self, fb: Any) -> None:
        """The attention backend is planning the capture-time batch: record it (it is what the graph bakes)."""
        bs = int(fb.batch_size)
        buf = self._buffers()
        mode = getattr(fb.dp_padding_mode, "is_max_len", None)
        host = {
            "forward_mode": getattr(fb.forward_mode, "name", str(fb.forward_mode)).lower(),
            "batch_size": bs,
            "num_tokens": int(fb.input_ids.shape[0]),
            "extend_num_tokens": fb.extend_num_tokens,
            "global_num_tokens_cpu": None if fb.global_num_tokens_cpu is None else [int(x) for x in fb.global_num_tokens_cpu],
            "global_num_tokens_for_logprob_cpu": (
                None if fb.global_num_tokens_for_logprob_cpu is None else [int(x) for x in fb.global_num_tokens_for_logprob_cpu]
            ),
            "global_dp_buffer_len": fb.global_dp_buffer_len,
            "dp_padding_mode": None if mode is None else ("max_len" if mode() else "sum_len"),
        }
        self.captures[bs] = CaptureRecord(bs, int(fb.input_ids.shape[0]), host, _tolist(buf.global_num_tokens_gpu),
                                          _tolist(buf.global_num_tokens_for_logprob_gpu))
        self.capture_rows[bs] = (self._rows_fed_to_lm_head(fb), int(fb.next_token_logits_buffer.shape[0]))

    def _rows_fed_to_lm_head(self, fb: Any) -> int:
        """Rows the engine's logits processor would give lm_head for this batch: its own row selection."""
        lp = self.engine.modules["logits"]
        meta = lp.LogitsMetadata.from_forward_batch(fb)
        hidden = torch.zeros(int(fb.input_ids.shape[0]), 1)
        self_stand_in = _Strict("LogitsProcessor")
        pruned = lp.LogitsProcessor._get_pruned_states(self_stand_in, hidden, None, None, meta)[0]
        return int(pruned.shape[0])

    def capture_all(self) -> None:
        """Every bucket, largest first, through the engine's capture path, stopping before the graph."""
        r, gen = self.runner, self.engine.generation
        for bs in reversed(self.capture_bs):
            if gen == "legacy":
                graph, out = r.capture_one_batch_size(bs, None)
                r.graphs[bs] = graph
                r.output_buffers[bs] = out
            else:
                r.capture_one_shape(bs, None)
            if bs not in self.captures:
                raise EngineAdapterError(
                    f"sglang {self.engine.version}: capturing bucket {bs} of the {self.kind} runner did not plan attention for a batch "
                    "of that size (init_forward_metadata_out_graph(..., in_capture=True) was not called)"
                )

    def install_graph_stand_ins(self) -> None:
        r = self.runner
        if self.engine.generation == "legacy":
            vars(r).update(
                graphs={}, output_buffers={}, stream=None,
                _create_graph=lambda: None,
                _capture_init=_noop,
            )
            handle = self

            def capture_graph(graph: Any, pool: Any, stream: Any, run_once: Callable) -> Any:
                return handle._fake_output(handle._capturing_bs)

            def create_graph() -> Any:
                return _FakeGraph(handle, handle._capturing_bs)

            vars(r).update(_capture_graph=capture_graph, _create_graph=create_graph)
            orig = r.capture_one_batch_size

            def capture_one_batch_size(bs: int, forward: Any, stream_idx: int = 0) -> Any:
                handle._capturing_bs = bs
                return orig(bs, forward, stream_idx)

            vars(r)["capture_one_batch_size"] = capture_one_batch_size
            vars(r).setdefault("deepep_adapter", _Strict("deepep_adapter", capture=_noop, replay=_noop))
        else:
            r.backend = _FakeGraphBackend(self)

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
        self.multi = self._build_multi_layer(sa)
        self.single = self._build_single_layer(sa)

    # ---- stand-ins ----
    def _model_runner(self, sa: Any, attn: _AttnBackend) -> _Strict:
        cfg = self.cfg
        spec_alg = self.engine.modules["spec_info"].SpeculativeAlgorithm
        hf_config = _Strict("model_config.hf_config")
        model_config = _Strict("model_config", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, spec_hidden_size=cfg.hidden_size,
                               dtype=torch.float32, hf_config=hf_config, model_is_mrope=False, is_multimodal=False)
        return _Strict(
            "model_runner", server_args=sa, device="cpu", gpu_id=0, tp_size=self.layout.tp_size, dp_size=self.layout.dp_size,
            tp_rank=self.tp_rank, model_config=model_config, spec_algorithm=spec_alg.from_string("EAGLE"),
            req_to_token_pool=_Strict("req_to_token_pool", size=cfg.max_running_requests), attn_backend=attn,
            canary_manager=None, device_timer=None, tp_group=_FakeGroup("tp", self.layout.tp_size, self.tp_rank),
            kv_index_translator=_Strict("kv_index_translator", bind_runner_slots=_noop),
            graph_shared_output=_Strict("graph_shared_output", get_logits_buffer=lambda vocab, rows: torch.zeros(rows, vocab)),
            model=_Strict("model"), model_context=contextlib.nullcontext, war_fastpath_read_done_event=None,
        )

    def _worker(self, sa: Any, backends: list[_AttnBackend], runners: list[_Strict]) -> _Strict:
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
        backends = [_AttnBackend() for _ in range(self.cfg.num_steps)]
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
            stack.enter_context(_patched(ml, "get_available_gpu_memory", lambda *a, **k: 0.0, eng.version, "logging only"))
            if eng.generation != "legacy":
                stack.enter_context(_patched(ml, "resolve_decode_backend", lambda runner: None, eng.version, "the graph backend"))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                comp._init_and_capture()
        if eng.generation == "prepare":
            utils = eng.modules["mle_utils"]
            ml.fill_draft_extend_prepare_buffers = _require(utils, "fill_draft_extend_prepare_buffers_native", eng.version,
                                                            "the native twin of the fused prepare() fill kernel")
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
        attn = _AttnBackend()
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
            comp.prepare(fb, staged=False)
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
        elif eng.generation == "prepare":
            accept = fb.spec_info.num_accept_tokens.to(torch.int64)
            select_index = torch.arange(live.raw_bs, dtype=torch.int64) * T + accept - 1
            res = r.execute(fb, select_index)
        else:
            res = r.execute(fb)
        return h.record(live, int(res.next_token_logits.shape[0]))
