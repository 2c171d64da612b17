"""Load an installed SGLang once per process, detect its runner API generation, shim its module globals.

API generations (detected from the classes, not the version string):
  legacy   runners own `graphs` / `output_buffers`; capture is capture_one_batch_size;
           replay(forward_batch, init_state); per-step widths num_steps + 1 + step;
           require_*(server_args); the oldest plan attention with
           init_forward_metadata_{capture,replay}_cuda_graph.
  runner   runners subclass DecodeCudaGraphRunner with a graph backend
           (resolve_decode_backend); capture_one_shape; execute(forward_batch).
  prepare  the composite owns one buffer set and one width for all steps;
           prepare(forward_batch) fills it, replay(step) replays; logits pruned to a row per
           request where no gathered buffer is needed; server args published into a
           runtime context (the newest: with the rank bundle).
docs/engine-check.md's release table says which release has which.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from harness.engines import lazy_compile
from harness.engines.install import write_engine_bytecode
from harness.engines.interpreter import prepare_interpreter
from harness.engines.sglang.errors import EngineAdapterError, require
from harness.engines.sglang.fill import WORKER_ROTATE, FillObserver, InPlaceLauncher, fill_name
from harness.engines.sglang.graph import AttnRecorder, recording_set_dp_buffer_len
from harness.engines.sglang.standins import noop
from harness.engines.sglang.stubs import LATE_STUBBED_MODULES, REAL_MODULES, StubFinder

_ML_MODULE = "sglang.srt.speculative.multi_layer_eagle_draft_extend_cuda_graph_runner"
_SL_MODULE = "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner"


@dataclass
class Engine:
    version: str
    location: str
    generation: str
    modules: dict[str, types.ModuleType]
    stubbed: list[str] = field(default_factory=list)
    fill: Optional[FillObserver] = None  # prepare()'s fused fill, observed (None: a Python fill)

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
    # the engine's Triton kernels run on CPU tensors under Triton's interpreter; the flag is read when a kernel is jitted
    os.environ["TRITON_INTERPRET"] = "1"
    lazy_compile.defer("sglang")  # its import-time torch.compile decorations would import TorchDynamo and Inductor
    write_engine_bytecode()
    finder = StubFinder()
    sys.meta_path.insert(0, finder)
    for name in REAL_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise EngineAdapterError(f"the engine adapter needs {name} for real ({e}); run python -m harness.engines.install") from e
    prepare_interpreter()  # loop bounds loaded from memory (rotate_input_ids); every access bounds-checked
    # SGLang logs and warns a lot at import on a CPU box ("only CUDA supports ..."): quiet it.
    logging.getLogger("sglang").setLevel(logging.ERROR)
    ml, sl = _import_runner_modules(finder)
    sglang = importlib.import_module("sglang")
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
    composite = require(ml, "MultiLayerEagleMultiStepDraftExtendCudaGraphRunner", version)
    runner_cls = require(ml, "MultiLayerEagleDraftExtendCudaGraphRunner", version)
    mods["parallel_state"] = importlib.import_module("sglang.srt.distributed.parallel_state")
    mods["dp_attention"] = importlib.import_module("sglang.srt.layers.dp_attention")
    if importlib.util.find_spec("sglang.srt.environ") is not None:  # the flags the worker picks its composite by
        mods["environ"] = importlib.import_module("sglang.srt.environ")
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


def _import_runner_modules(finder: StubFinder) -> tuple[types.ModuleType, types.ModuleType]:
    """The two runner modules; a LATE_STUBBED_MODULES import that fails is stubbed and the import retried once each."""
    while True:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                return importlib.import_module(_ML_MODULE), importlib.import_module(_SL_MODULE)
            except ModuleNotFoundError as e:
                top = (e.name or "").split(".")[0]
                if top in LATE_STUBBED_MODULES and top not in finder.names:
                    finder.names = finder.names | {top}
                    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
                        del sys.modules[name]  # the half-imported package: import it again with the stub
                    continue
                if top and top != "sglang":
                    raise EngineAdapterError(
                        f"importing the runner modules needs {e.name!r}, which is neither installed nor stubbed: "
                        "add it to STUBBED_MODULES in harness/engines/sglang/stubs.py"
                    ) from e
                raise EngineAdapterError(f"this sglang has no {e.name} (not an EAGLE draft-extend runner release?)") from e


def _install_module_shims(engine: Engine) -> None:
    """Process-wide swaps in the runner modules (engine-check runs one engine per process)."""
    ml, sl = engine.modules["ml"], engine.modules["sl"]
    # get_available_gpu_memory: only logged around each capture; needs a device
    ml.get_available_gpu_memory = lambda *a, **k: 0.0
    # set_dp_buffer_len: recorded (and still run) so the capture-time DP buffer setup is visible
    for mod in (ml, sl):
        real = require(mod, "set_dp_buffer_len", engine.version, "the step body's DP buffer setup")
        mod.set_dp_buffer_len = recording_set_dp_buffer_len(real)
    # flashinfer autotuning runs the step body (the model) before capture: nothing to tune here
    for mod in (ml, sl):
        if hasattr(mod, "maybe_flashinfer_autotune_speculative_draft"):
            mod.maybe_flashinfer_autotune_speculative_draft = noop
    if engine.generation == "prepare":
        # the fused fill (where the release has one) stays the engine's; the observer adds its native twin's result
        name = fill_name(ml)
        if name is not None:
            native = getattr(engine.modules["mle_utils"], "fill_draft_extend_prepare_buffers_native", None)
            engine.fill = FillObserver(getattr(ml, name), native)
            setattr(ml, name, engine.fill)
        # the chain rotation's interpreted kernel, memoized (fill.py): every layout and rank captures the one graph on the same state
        wrapped: dict[int, InPlaceLauncher] = {}
        for mod in (ml, engine.modules["mle_utils"]):
            for rot in WORKER_ROTATE:
                fn = getattr(mod, rot, None)
                if callable(fn):
                    setattr(mod, rot, wrapped.setdefault(id(fn), InPlaceLauncher(fn)))


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


def attn_backend_class(engine: Engine) -> type:
    """The release's own AttentionBackend with the recorder mixed in: its defaults stay the engine's."""
    base_mod = importlib.import_module("sglang.srt.layers.attention.base_attn_backend")
    Base = require(base_mod, "AttentionBackend", engine.version)
    cls = type("EngineCheckAttnBackend", (AttnRecorder, Base), {"__abstractmethods__": frozenset()})
    return cls
