"""Load an installed vllm-ascend (its Python tree) over the vLLM release it pairs with, on a CPU, once per process.

What stays the engine's: the EAGLE proposer of the model runner the release runs on this vLLM
(AscendEagleProposer: its dummy_run captures the merged draft graph, its _propose replays it,
_run_merged_draft is the graph's body, attn_update_stack_num_spec_norm builds each draft
step's metadata, prepare_inputs_padded and its Triton kernel), ACLGraphWrapper (capture and
replay per batch descriptor), the attention backend (AscendAttentionMetadataBuilder,
AscendAttentionBackendImpl: full_graph_fia records each step's attention task at capture,
update_graph_params rewrites them before a replay), set_ascend_forward_context, AscendConfig,
vLLM's CudagraphDispatcher. Three of NPUModelRunner's methods the proposer calls are compiled
from the release's model_runner_v1.py, never imported (importing it pulls the whole patch and
serving stack): _sync_metadata_across_dp, _pad_query_start_loc_for_fia, _use_aclgraph, and
the module function _post_process_cudagraph_mode they read.

What is swapped, process-wide (one engine per process), each for its reason:
  torch_npu, torch.npu                 no Ascend runtime: npu.py's recording stand-ins
  triton.language.extra.cann.extension triton-ascend's slice ops, read at import by kernels never run here
  get_dp_group, dist                   the calling thread's rank of a DPWorld (the vLLM adapter's)
  get_tensor_model_parallel_world_size one TP rank
  get_pp_group (proposer)              one pipeline stage
  current_platform (acl_graph)         no graph memory pool
  _NUM_VECTORCORE                      the vector-core count a kernel's grid is sized by (an A2's)
  acl_graph's parameter tables         one per DP rank (npu.RankTables: the ranks are threads of one process here)
  torch.Tensor.pin_memory              no pinned host memory without an accelerator: pinning returns the tensor
  is_pin_memory_available / PIN_MEMORY (vLLM's proposer)  False, for the same reason
"""
from __future__ import annotations

import ast
import builtins
import importlib
import json
import logging
import os
import re
import sys
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from harness.engines.install import write_engine_bytecode
from harness.engines.interpreter import patch_interpreter_index
from harness.engines.sglang.errors import EngineAdapterError, ReleaseNotCovered
from harness.engines.sglang.stubs import StubFinder
from harness.engines.vllm.loader import _import_real_triton
from harness.engines.vllm.standins import DPWorld, dist_standin
from harness.engines.vllm.stubs import REAL_MODULES, StubDistributionFinder
from harness.engines.vllm.stubs import STUBBED_MODULES as VLLM_STUBBED
from harness.engines.vllm_ascend.install import RELEASE_FILE
from harness.engines.vllm_ascend.npu import NpuRuntime, build_modules
from runners.attention.triton_interpreter import speed_up_interpreter

# Third-party imports of the driven modules beyond the vLLM adapter's list, never exercised on the driven path
STUBBED_MODULES = (*VLLM_STUBBED, "numba", "scipy", "compressed_tensors")
CANN_EXTENSION = "triton.language.extra.cann.extension"
VECTOR_CORES = 48  # an Atlas A2's vector cores: prepare_inputs_padded's grid is min(blocks, cores), its kernel grid-strides
MODULES = {
    "proposer": "vllm_ascend.spec_decode.llm_base_proposer",
    "eagle": "vllm_ascend.spec_decode.eagle_proposer",
    "acl_graph": "vllm_ascend.compilation.acl_graph",
    "attention": "vllm_ascend.attention.attention_v1",
    "attention_utils": "vllm_ascend.attention.utils",
    "forward_context": "vllm_ascend.ascend_forward_context",
    "ascend_config": "vllm_ascend.ascend_config",
    "utils": "vllm_ascend.utils",
    "worker_utils": "vllm_ascend.worker.utils",
    "triton_utils": "vllm_ascend.ops.triton.triton_utils",
    "dispatcher": "vllm.v1.cudagraph_dispatcher",
    "vllm_forward_context": "vllm.forward_context",
    "monitor": "vllm.compilation.monitor",
    "kv_cache_interface": "vllm.v1.kv_cache_interface",
    "attention_layer_base": "vllm.model_executor.layers.attention_layer_base",
    "compilation": "vllm.config.compilation",
    "vllm_config": "vllm.config",
    "vllm_utils": "vllm.v1.utils",
}
RUNNER_FILE = "vllm_ascend/worker/model_runner_v1.py"
RUNNER_CLASS = "NPUModelRunner"
RUNNER_METHODS = ("_sync_metadata_across_dp", "_pad_query_start_loc_for_fia", "_use_aclgraph")
RUNNER_FUNCTIONS = ("_post_process_cudagraph_mode",)
# The merged draft graph this adapter drives (the proposer's graph body); a release without it is n/a
GRAPH_BODY = ("AscendSpecDecodeBaseProposer", "_run_merged_draft")


@dataclass
class AscendEngine:
    version: str
    vllm_version: str
    location: str
    modules: dict[str, types.ModuleType]
    runtime: NpuRuntime
    runner_methods: dict[str, Callable[..., Any]]  # compiled from the release's model runner (module docstring)
    runner_where: dict[str, str]  # name -> file:line of its definition
    stubbed: list[str] = field(default_factory=list)
    v2_note: str = ""  # why model runner v2's speculator is not driven, from the release's worker (v2_runner_note)
    world: Optional[DPWorld] = None

    def describe(self) -> str:
        return f"vllm-ascend {self.version} (vllm {self.vllm_version}) from {self.location}"

    def attr(self, key: str, name: str) -> Any:
        mod = self.modules[key]
        if not hasattr(mod, name):
            raise EngineAdapterError(f"vllm-ascend {self.version}: {mod.__name__}.{name} not found; the release moved it: "
                                     "teach harness/engines/vllm_ascend where it went")
        return getattr(mod, name)


_LOADED: Optional[AscendEngine] = None


def read_release(tree: Path) -> dict[str, str]:
    """The release's identity as install.py recorded it: {"version", "vllm", "vllm_source"}."""
    path = tree / RELEASE_FILE
    if not path.is_file():
        raise EngineAdapterError(f"no {RELEASE_FILE} under {tree}: not an install of harness engine-check (reinstall with --install)")
    return json.loads(path.read_text())


def load(tree: Path, vllm_target: Path, deps: list[Path]) -> AscendEngine:
    """Import vllm_ascend from `tree` over vllm from `vllm_target` (pip --target dirs), once per process."""
    global _LOADED
    if _LOADED is not None:
        if Path(_LOADED.location).resolve() != Path(tree).resolve():
            raise EngineAdapterError(f"an engine is already loaded in this process ({_LOADED.describe()}); run one engine per process")
        return _LOADED
    if "vllm" in sys.modules or "vllm_ascend" in sys.modules:
        raise EngineAdapterError("vllm was imported before the adapter could choose its location")
    release = read_release(tree)
    if not (tree / "vllm_ascend").is_dir():
        raise EngineAdapterError(f"no vllm_ascend package under {tree}")
    if not (vllm_target / "vllm").is_dir():
        raise EngineAdapterError(f"no vllm package under {vllm_target} (vllm-ascend {release['version']} runs on vllm {release['vllm']})")
    sys.path[:0] = [str(tree), str(vllm_target)]
    for d in deps:
        if Path(d).is_dir():
            sys.path.append(str(d))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ["TRITON_INTERPRET"] = "1"  # prepare_inputs_padded's kernel runs on CPU tensors under Triton's interpreter
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # the model runner this pairing runs (worker.py refuses v2 on vllm 0.23.0)
    write_engine_bytecode()
    finder = StubFinder(STUBBED_MODULES)
    sys.meta_path.insert(0, finder)
    sys.meta_path.insert(0, StubDistributionFinder())
    for name in REAL_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise EngineAdapterError(f"the vllm-ascend adapter needs {name} for real ({e}); run harness engine-check --install") from e
    runtime = NpuRuntime()
    _install_npu(runtime)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    logging.getLogger("vllm_ascend").setLevel(logging.ERROR)
    mods: dict[str, types.ModuleType] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _import_real_triton()
        patch_interpreter_index()
        speed_up_interpreter()
        vllm = importlib.import_module("vllm")
        vllm_version = getattr(vllm, "__version__", "unknown")
        if vllm_version != release["vllm"]:
            raise EngineAdapterError(f"vllm-ascend {release['version']} runs on vllm {release['vllm']} ({release['vllm_source']}); "
                                     f"found vllm {vllm_version} at {vllm_target}")
        try:
            # the release's own import order: vllm_ascend.ops before the attention backend (device_op and
            # ops.fused_moe import each other; the platform plugin imports ops first in a served process)
            importlib.import_module("vllm_ascend.ops")
            for key, name in MODULES.items():
                mods[key] = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] in ("vllm", "vllm_ascend"):
                raise EngineAdapterError(f"importing the proposer modules needs {e.name}, which this release lacks") from e
            raise EngineAdapterError(f"importing the proposer modules needs {e.name!r}, neither installed nor stubbed: "
                                     "add it to STUBBED_MODULES in harness/engines/vllm_ascend/loader.py") from e
    cls = getattr(mods["proposer"], GRAPH_BODY[0], None)
    if cls is None or not hasattr(cls, GRAPH_BODY[1]):
        raise ReleaseNotCovered(f"vllm-ascend {release['version']} has no {'.'.join(GRAPH_BODY)} (the merged draft graph's body) "
                                f"in {MODULES['proposer']}")
    methods, where = compile_runner_methods(tree / RUNNER_FILE, release["version"], runner_globals(mods))
    _LOADED = AscendEngine(release["version"], vllm_version, str(tree), mods, runtime, methods, where, sorted(finder.served),
                           v2_runner_note(tree, vllm_version))
    runtime.rank_of = _current_rank
    runtime.forward_context = mods["vllm_forward_context"]
    _install_shims(_LOADED)
    return _LOADED


WORKER_FILE = "vllm_ascend/worker/worker.py"
V2_REFUSED = re.compile(r'use_v2_model_runner and vllm_version_is\("([^"]+)"\)')


def v2_runner_note(tree: Path, vllm_version: str) -> str:
    """Why the adapter drives the v1 model runner's proposer and not model runner v2's speculator (worker/v2): the
    release's worker refuses v2 on the vLLM it pairs with, or v2 is off unless VLLM_USE_V2_MODEL_RUNNER asks for it."""
    path = tree / WORKER_FILE
    lines = path.read_text().splitlines() if path.is_file() else []
    refusal = next(((i + 1, m.group(1)) for i, ln in enumerate(lines) if (m := V2_REFUSED.search(ln))), None)
    if refusal is not None and refusal[1] == vllm_version:
        return (f"model runner v2's speculator (worker/v2/spec_decode): on vllm {vllm_version} the worker falls back to the v1 runner "
                f"({WORKER_FILE}:{refusal[0]}); the v1 runner's merged draft graph is what serves speculative decoding")
    return ("model runner v2's speculator (worker/v2/spec_decode): not driven; it runs only under VLLM_USE_V2_MODEL_RUNNER=1 "
            "(off by default: patch/platform/patch_use_v2_model_runner.py), the adapter drives the default v1 runner")


def _install_npu(runtime: NpuRuntime) -> None:
    npu, torch_npu = build_modules(runtime)
    torch.npu = npu  # torch_npu registers torch.npu on import
    sys.modules["torch_npu"] = torch_npu
    sys.modules["torch_npu._C"] = torch_npu._C
    import triton.language  # noqa: F401  (the real one: the extension module lives under it)

    parent = types.ModuleType(CANN_EXTENSION.rsplit(".", 1)[0])
    parent.__path__ = []
    ext = types.ModuleType(CANN_EXTENSION)
    for op in ("insert_slice", "extract_slice", "get_element"):  # jit-compiled into FLA kernels never launched here
        setattr(ext, op, _unlaunched(op))
    sys.modules[parent.__name__] = parent
    sys.modules[CANN_EXTENSION] = ext


def _unlaunched(op: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise EngineAdapterError(f"a kernel using triton-ascend's {op} was launched: not on the path the adapter drives")

    return refuse


def compile_runner_methods(path: Path, version: str, provided: dict[str, Callable[[], Any]]
                           ) -> tuple[dict[str, Callable[..., Any]], dict[str, str]]:
    """NPUModelRunner's RUNNER_METHODS and the module's RUNNER_FUNCTIONS, compiled from the release's source with their line
    numbers (tracebacks point into it). Every global they read must be a key of `provided` (its value resolved only when
    read) or one of the compiled functions."""
    if not path.is_file():
        raise EngineAdapterError(f"vllm-ascend {version}: no {RUNNER_FILE}; teach harness/engines/vllm_ascend where the model runner went")
    tree = ast.parse(path.read_text(), filename=str(path))
    runner = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == RUNNER_CLASS), None)
    if runner is None:
        raise EngineAdapterError(f"vllm-ascend {version}: {path} has no {RUNNER_CLASS}")
    found: dict[str, ast.FunctionDef] = {}
    for n in runner.body:
        if isinstance(n, ast.FunctionDef) and n.name in RUNNER_METHODS:
            found[n.name] = n
    for n in tree.body:
        if isinstance(n, ast.FunctionDef) and n.name in RUNNER_FUNCTIONS:
            found[n.name] = n
    missing = [m for m in (*RUNNER_METHODS, *RUNNER_FUNCTIONS) if m not in found]
    if missing:
        raise EngineAdapterError(f"vllm-ascend {version}: {path} lacks {', '.join(missing)}; teach harness/engines/vllm_ascend")
    namespace: dict[str, Any] = {}
    where: dict[str, str] = {}
    for name, node in found.items():
        free = _free_names(node) - set(found) - set(dir(builtins))
        unknown = free - set(provided)
        if unknown:
            raise EngineAdapterError(f"vllm-ascend {version}: {RUNNER_FILE}:{node.lineno} {name} reads {', '.join(sorted(unknown))}, "
                                     "which the adapter does not provide; teach harness/engines/vllm_ascend/loader.py")
        for g in free - set(namespace):
            try:
                namespace[g] = provided[g]()
            except AttributeError as e:
                raise EngineAdapterError(f"vllm-ascend {version}: {RUNNER_FILE}:{node.lineno} {name} reads {g}, which this release "
                                         f"does not have where model_runner_v1.py imports it from ({e})") from e
        node.decorator_list = []
        module = ast.Module(body=[node], type_ignores=[])
        exec(compile(module, str(path), "exec"), namespace)  # noqa: S102  (the release's own function, compiled from its file)
        where[name] = f"{RUNNER_FILE}:{node.lineno}"
    return {name: namespace[name] for name in found}, where


def runner_globals(mods: dict[str, types.ModuleType]) -> dict[str, Callable[[], Any]]:
    """The module globals the compiled runner functions may read, each what model_runner_v1.py imports under that name
    (resolved when a function reads it: releases differ in what they import)."""
    return {"torch": lambda: torch, "np": lambda: np, "dist": dist_standin, "get_dp_group": lambda: _current_group,
            "CUDAGraphMode": lambda: mods["vllm_config"].CUDAGraphMode, "CompilationMode": lambda: mods["vllm_config"].CompilationMode,
            "should_skip_allreduce_across_dp_group": lambda: mods["utils"].should_skip_allreduce_across_dp_group,
            "copy_snapshot_to_gpu": lambda: mods["worker_utils"].copy_snapshot_to_gpu,
            "breakable_cudagraph": lambda: importlib.import_module("vllm.compilation.breakable_cudagraph")}


def _free_names(fn: ast.FunctionDef) -> set[str]:
    """Names a function reads that it neither binds nor takes (its globals)."""
    bound = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
    bound |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))}
    return {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def _current_group() -> Any:
    if _LOADED is None or _LOADED.world is None:
        raise EngineAdapterError("vllm-ascend asked for the DP group with no DP world set")
    return _LOADED.world.group()


def _current_rank() -> int:
    """The calling thread's DP rank (0 with no world: one rank)."""
    if _LOADED is None or _LOADED.world is None:
        return 0
    return _LOADED.world.group().rank_in_group


def _install_shims(engine: AscendEngine) -> None:
    fc, attention = engine.modules["forward_context"], engine.modules["attention"]
    for mod in (fc, engine.modules["utils"]):
        if hasattr(mod, "get_dp_group"):
            mod.get_dp_group = _current_group
    for mod in (fc, attention, engine.modules["proposer"]):
        if hasattr(mod, "get_tensor_model_parallel_world_size"):
            mod.get_tensor_model_parallel_world_size = lambda: 1
    engine.attr("proposer", "get_pp_group")
    engine.modules["proposer"].get_pp_group = lambda: types.SimpleNamespace(is_first_rank=True, is_last_rank=True, world_size=1)
    engine.attr("acl_graph", "current_platform")
    engine.modules["acl_graph"].current_platform = types.SimpleNamespace(get_global_graph_pool=lambda: None)
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    vllm_proposer = sys.modules["vllm.v1.spec_decode.llm_base_proposer"]
    if hasattr(vllm_proposer, "is_pin_memory_available"):
        vllm_proposer.is_pin_memory_available = lambda: False
    if hasattr(vllm_proposer, "PIN_MEMORY"):  # from vLLM 0.24: the answer computed once at import
        vllm_proposer.PIN_MEMORY = False
    engine.attr("triton_utils", "_NUM_VECTORCORE")
    engine.modules["triton_utils"]._NUM_VECTORCORE = VECTOR_CORES
