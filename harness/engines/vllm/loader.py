"""Load an installed vLLM once per process and swap the module globals that need a GPU.

What stays the engine's: the graph managers (CudaGraphManager, SpeculatorCudaGraphManager:
their capture tables, capture loop and dispatch), the capture-shape rules in vllm.config,
the DP agreement (dispatch_cg_and_sync_dp / sync_cudagraph_and_dp_padding), the proposer's
multi-step decode drive (_run_multi_step_decode, _build_uniform_batch_dp_sync), its choice
of the per-step or the fused multi-step decode and both loops, its input-prep Triton kernel
and BlockTables.compute_slot_mappings' kernel (run by Triton's interpreter on CPU tensors, the
code a GPU runs), prepare_inputs_to_capture (a capture's dummy batch). No attention backend
runs: the draft's attention group and its metadata builder are stand-ins (standins.py:
DraftAttnGroup says whether it can update draft-decode metadata in place, which is how the
release picks the decode path), and so are the model state's prepare_attn and the proposer's
_build_uniform_attn_metadata, which build through that group (drive.py).

Which releases it claims: those with the EAGLE speculator's graph managers (GRAPH_PATH), each
captured on its own (0.27.0 on; up to 0.24 the draft prefill's capture takes the target's
captured attention states), and a capture API that api.py speaks (token-keyed up to 0.33, the
target's decode query length the model runner's up to 0.28; request-keyed from 0.34). Others are
imported as far as vllm.config and the graph manager and then said n/a with the reason
(errors.ReleaseNotCovered), so a release table tells the path's absence, an older API and an
adapter that fell behind apart.

What is swapped, process-wide (one engine per process), each for its reason:
  torch.cuda.graph / CUDAGraph   no device: the capture pass's forward is recorded as the bake, and
                                  the call made inside the capture is the graph's body, re-run at replay
  graph_capture, capture_pool     device streams and memory pools (set_graph_pool_id up to 0.31)
  get_pp_group, current_platform  one pipeline stage; no graph pool
  get_offloader, current_stream   weight offload and streams sync on a device (current_stream from 0.29)
  is_global_first_rank            False: no progress bars
  build_slot_mappings_by_layer    per-layer views of the KV cache config (no layers here), in the decode
                                  loops' modules and prepare_inputs_to_capture's
  get_dp_group                    the calling thread's rank of a DPWorld (standins.py)
  should_skip_dp_coordination     False: the ranks really agree (from 0.30)
  dist (up to 0.32)               all_reduce over the DP group's cpu_group: the DPWorld's sum
  dispatch_cg_and_sync_dp         in the speculator modules: the engine's own, each call's result noted
                                  (what the draft prefill agreed is not passed on when its graph replays)
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os
import sys
import threading
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from harness.engines.install import write_engine_bytecode
from harness.engines.interpreter import prepare_interpreter
from harness.engines.sglang.errors import EngineAdapterError, ReleaseNotCovered
from harness.engines.sglang.stubs import StubFinder
from harness.engines.vllm.api import CaptureApi, capture_api
from harness.engines.vllm.standins import (
    DPWorld,
    GraphCapture,
    Strict,
    dist_standin,
    null_graph_capture,
    null_pool,
    torch_proxy,
)
from harness.engines.vllm.stubs import REAL_MODULES, STUBBED_MODULES, StubDistributionFinder

# Where each module the adapter drives lives, newest layout first: up to 0.33 the autoregressive
# speculator and its graph manager were the target-dependent speculator's own modules.
MODULES: dict[str, tuple[str, ...]] = {
    "cg": ("vllm.v1.worker.gpu.cudagraph_utils",),
    "scg": ("vllm.v1.worker.gpu.spec_decode.autoregressive.cudagraph_utils",
            "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils"),
    "dp": ("vllm.v1.worker.gpu.dp_utils",),
    "ar": ("vllm.v1.worker.gpu.spec_decode.autoregressive.speculator",
           "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator"),
    "propose": ("vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator",
                "vllm.v1.worker.gpu.spec_decode.autoregressive.speculator"),
    "spec": ("vllm.v1.worker.gpu.spec_decode.speculator",),
    "eagle": ("vllm.v1.worker.gpu.spec_decode.eagle.speculator",),
    "compilation": ("vllm.config.compilation",),
    "config": ("vllm.config.vllm",),
    "input_batch": ("vllm.v1.worker.gpu.input_batch",),
    "block_table": ("vllm.v1.worker.gpu.block_table",),
}
# The EAGLE speculator's graph managers in model runner v2, in every layout a release has had
# (newest first): a release with none of them does not carry the path this adapter checks.
GRAPH_PATH = (
    "vllm.v1.worker.gpu.spec_decode.autoregressive.cudagraph_utils",
    "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils",
    "vllm.v1.worker.gpu.spec_decode.eagle.cudagraph",
    "vllm.v1.worker.gpu.spec_decode.eagle_cudagraph",
)


@dataclass
class VllmEngine:
    version: str
    location: str
    modules: dict[str, types.ModuleType]
    capture: GraphCapture
    api: CaptureApi  # how the release keys its decode graphs (api.py)
    stubbed: list[str] = field(default_factory=list)
    world: Optional[DPWorld] = None  # the DP world now being driven (get_dp_group reads it)
    # per rank thread (the ranks' proposers run at once): `log`, while a proposer runs, its (manager, descriptor, DP sync) dispatches
    dispatched: threading.local = field(default_factory=threading.local)

    def describe(self) -> str:
        return f"vllm {self.version} from {self.location}"

    def attr(self, key: str, name: str) -> Any:
        """A module attribute the adapter drives; a release without it cannot be driven (exit 2)."""
        mod = self.modules[key]
        if not hasattr(mod, name):
            raise EngineAdapterError(f"vllm {self.version}: {mod.__name__}.{name} not found; the release moved it: "
                                     "teach harness/engines/vllm where it went")
        return getattr(mod, name)


_LOADED: Optional[VllmEngine] = None


def load(target: Optional[Path], deps: list[Path]) -> VllmEngine:
    """Import vllm from `target` (a pip --target dir; None: the environment's), once per process."""
    global _LOADED
    if _LOADED is not None:
        if target is not None and Path(_LOADED.location).resolve() != Path(target).resolve():
            raise EngineAdapterError(f"an engine is already loaded in this process ({_LOADED.describe()}); run one engine per process")
        return _LOADED
    if "vllm" in sys.modules and target is not None:
        raise EngineAdapterError("vllm was imported before the adapter could choose its location")
    if target is not None:
        if not (Path(target) / "vllm").is_dir():
            raise EngineAdapterError(f"no vllm package under {target}")
        sys.path.insert(0, str(target))
    for d in deps:
        if Path(d).is_dir():
            sys.path.append(str(d))  # after site-packages: the interpreter's own copies win
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vllm logs to stdout, where --json writes its document
    os.environ["TRITON_INTERPRET"] = "1"  # the input-prep kernels run on CPU tensors under Triton's interpreter
    write_engine_bytecode()
    finder = StubFinder(STUBBED_MODULES)
    sys.meta_path.insert(0, finder)
    sys.meta_path.insert(0, StubDistributionFinder())
    for name in REAL_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise EngineAdapterError(f"the vLLM adapter needs {name} for real ({e}); run harness engine-check --install") from e
    logging.getLogger("vllm").setLevel(logging.ERROR)
    mods: dict[str, types.ModuleType] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _import_real_triton()
        prepare_interpreter()
        vllm = importlib.import_module("vllm")
        location = str(Path(vllm.__file__).resolve().parent.parent)
        version = _version_of(vllm, location)
        try:
            path = _require_graph_path(version)
            for key in ("config", "cg"):
                mods[key] = _import_first(MODULES[key])
            api = capture_api(mods["config"].VllmConfig, getattr(mods["cg"], "CudaGraphManager", None), version, path)
            _require_own_capture(importlib.import_module(path), version)
            for key, names in MODULES.items():
                mods[key] = _import_first(names)
        except ModuleNotFoundError as e:
            raise _missing_module(e) from e
    _LOADED = VllmEngine(version, location, mods, GraphCapture(), api, sorted(finder.served))
    _install_shims(_LOADED)
    return _LOADED


def _import_first(names: tuple[str, ...]) -> types.ModuleType:
    present = [n for n in names if _spec_exists(n)]
    if not present:
        raise EngineAdapterError(f"this vllm has none of {', '.join(names)}: the release moved it")
    return importlib.import_module(present[0])


def _missing_module(e: ModuleNotFoundError) -> EngineAdapterError:
    if (e.name or "").split(".")[0] == "vllm":
        return EngineAdapterError(f"importing the proposer modules needs {e.name}, which this release lacks")
    return EngineAdapterError(f"importing the proposer modules needs {e.name!r}, neither installed nor stubbed: "
                              "add it to STUBBED_MODULES in harness/engines/vllm/stubs.py")


def _require_graph_path(version: str) -> str:
    found = [n for n in GRAPH_PATH if _spec_exists(n)]
    if not found:
        raise ReleaseNotCovered(f"vllm {version} has no model-runner-v2 EAGLE speculator graph path (none of {', '.join(GRAPH_PATH)})")
    return found[0]


def _require_own_capture(graph_module: types.ModuleType, version: str) -> None:
    """Up to 0.24 the speculator's prefill graphs are captured from the attention states the target's capture
    returned (its manager's capture takes them): the adapter captures the speculator's graphs on their own, each
    manager building its capture batch and metadata (prepare_inputs_to_capture), as 0.27.0 and later do."""
    for name, cls in sorted(vars(graph_module).items()):
        if not isinstance(cls, type) or cls.__module__ != graph_module.__name__ or "capture" not in vars(cls):
            continue
        taken = [p for p in inspect.signature(cls.capture).parameters if p.endswith("attn_states")]
        if taken:
            raise ReleaseNotCovered(f"vllm {version} carries model runner v2's EAGLE speculator graph path ({graph_module.__name__}), "
                                    f"but its draft prefill graphs are captured from the target's captured attention states "
                                    f"({name}.capture({taken[0]}=...), which the target's CudaGraphManager.capture returns): a capture "
                                    "protocol the adapter does not drive (it captures each speculator manager on its own, as 0.27.0 "
                                    "and later do)")


def _spec_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):  # `name` or a parent package is missing
            return False
        raise


def _install_shims(engine: VllmEngine) -> None:
    cg, dp = engine.modules["cg"], engine.modules["dp"]
    for name in ("torch", "graph_capture", "get_pp_group", "current_platform", "get_offloader", "is_global_first_rank"):
        engine.attr("cg", name)
    engine.attr("cg", "capture_pool" if hasattr(cg, "capture_pool") else "set_graph_pool_id")  # the pool API up to 0.31
    cg.torch = torch_proxy(engine.capture)
    cg.graph_capture = null_graph_capture
    cg.capture_pool = null_pool
    cg.set_graph_pool_id = lambda pool: None
    cg.get_pp_group = lambda: Strict("pp_group", is_first_rank=True, is_last_rank=True)
    cg.current_platform = Strict("current_platform", get_global_graph_pool=lambda: None, graph_pool_handle=lambda: None)
    cg.get_offloader = lambda: Strict("offloader", sync_prev_onload=lambda: None, join_after_forward=lambda: None)
    if hasattr(cg, "current_stream"):  # from 0.29: graphs are captured on it
        cg.current_stream = lambda: None
    cg.is_global_first_rank = lambda: False
    engine.attr("ar", "build_slot_mappings_by_layer")
    for key in ("ar", "propose", "cg"):  # the decode loops, and prepare_inputs_to_capture
        if hasattr(engine.modules[key], "build_slot_mappings_by_layer"):
            engine.modules[key].build_slot_mappings_by_layer = lambda slot_mappings, kv_cache_config: slot_mappings
    engine.attr("dp", "get_dp_group")

    def get_dp_group() -> Any:
        if engine.world is None:
            raise EngineAdapterError("vllm asked for the DP group with no DP world set")
        return engine.world.group()

    dp.get_dp_group = get_dp_group
    if hasattr(dp, "should_skip_dp_coordination"):  # from 0.30; before, the agreement always ran its collective
        dp.should_skip_dp_coordination = lambda: False
    if hasattr(dp, "dist"):
        dp.dist = dist_standin()
    for key in ("ar", "propose"):
        _note_dispatches(engine, key)


def _note_dispatches(engine: VllmEngine, key: str) -> None:
    mod = engine.modules[key]
    real = engine.attr(key, "dispatch_cg_and_sync_dp")
    if getattr(real, "engine_check_noted", False):
        return

    def dispatch_cg_and_sync_dp(cudagraph_manager: Any, *args: Any, **kwargs: Any) -> Any:
        desc, sync = real(cudagraph_manager, *args, **kwargs)
        log = getattr(engine.dispatched, "log", None)
        if log is not None:
            log.append((cudagraph_manager, desc, sync))
        return desc, sync

    dispatch_cg_and_sync_dp.engine_check_noted = True  # type: ignore[attr-defined]
    mod.dispatch_cg_and_sync_dp = dispatch_cg_and_sync_dp


def _import_real_triton() -> None:
    """vllm.triton_utils swaps triton for a placeholder unless exactly one GPU driver is active; with
    CUDA_VISIBLE_DEVICES empty (its "devices not yet visible" case) it keeps the real triton, whose
    interpreter then runs the kernels."""
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        tu = importlib.import_module("vllm.triton_utils")
    finally:
        if old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old
    if not getattr(tu, "HAS_TRITON", False):
        raise EngineAdapterError("vllm.triton_utils replaced triton by its placeholder: the input-prep kernels cannot run")


def _version_of(vllm: types.ModuleType, location: str) -> str:
    for dist in Path(location).glob("vllm-*.dist-info"):
        return dist.name[len("vllm-"):-len(".dist-info")]
    v = getattr(vllm, "__version__", None)
    return v if isinstance(v, str) else "unknown"
