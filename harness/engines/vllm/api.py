"""How a vLLM release keys its uniform-decode CUDA graphs, and the capture-size rules that follow.

Model runner v2 has keyed them two ways. Up to 0.33 they are token-keyed: the user gives
`cudagraph_capture_sizes` (tokens), VllmConfig._set_cudagraph_sizes settles them at config
time, and each manager, built with one `decode_query_len`, turns every token size into a
uniform-decode graph of round_up(size, q) / q requests. From 0.34 they are request-keyed:
the user gives `decode_cudagraph_capture_request_sizes`, managers take a query-length map and
the draft decode has its own grid (VllmConfig.get_draft_decode_cudagraph_request_sizes).

Before VllmConfig.uniform_decode_query_len (up to 0.28) the token-keyed target manager's
`decode_query_len` is GPUModelRunner's own attribute, set in the model runner that the adapter
does not drive: its value is computed by evaluating that assignment as the release wrote it
(model_runner.py, parsed, never imported), so a release that derives it otherwise is noticed.

One object per API, chosen once by what the release's VllmConfig has (never by version
string): it builds the configuration the engine reads and states the rule each capture table
must follow, written from the release's rule, so the engine's tables are checked against it.
"""
from __future__ import annotations

import ast
import enum
import importlib
import importlib.util
import inspect
from pathlib import Path
from typing import Any, Optional

from harness.engines.sglang.errors import EngineAdapterError, ReleaseNotCovered
from harness.engines.vllm.config import VllmCheckConfig
from harness.engines.vllm.standins import Strict

# (field, expected, reason) of one capture-size rule on one runner's FULL graphs: their request counts, or for
# SMALLEST_LARGEST the first and last of them
Rule = tuple[str, Any, str]
SMALLEST_LARGEST = "smallest / largest graph"


class DispatchOrder(enum.Enum):
    """Which captured graph a release's CudaGraphManager.dispatch hands a batch (its `_init_candidates` order); the value
    is the rule as the check's message states it."""

    FULL_FIRST = ("the smallest FULL graph holding the batch's requests, else the smallest PIECEWISE size holding its "
                  "tokens, eager when none does (candidates grouped per mode, FULL first)")
    SMALLEST_GRAPH = ("the graphs of the smallest captured token count holding the batch's tokens, whatever their mode, "
                      "FULL first among them; eager when none does (candidates grouped by token count alone)")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class CaptureApi:
    """The request-keyed API (0.34 on)."""

    name = "mrv2"
    bound = ("uniform_decode_query_len", "get_decode_cudagraph_query_lens", "get_draft_decode_cudagraph_request_sizes")
    dispatch = DispatchOrder.FULL_FIRST

    def compilation(self, mode: Any, cfg: VllmCheckConfig) -> Strict:
        return Strict("compilation_config", cudagraph_mode=mode, prefill_cudagraph_capture_token_sizes=[],
                      decode_cudagraph_capture_request_sizes=list(cfg.decode_request_sizes),
                      max_cudagraph_capture_size=cfg.max_cudagraph_capture_size, max_decode_cudagraph_capture_tokens=None,
                      max_decode_cudagraph_capture_requests=None, use_breakable_cudagraph=False)

    def settle(self, vllm_config_cls: type, compilation_config_cls: type, vcfg: Strict) -> None:
        """Anything the release derives from the flags at config time (here: read on use)."""

    def target_manager_kwargs(self, vcfg: Strict) -> dict[str, Any]:
        return {"decode_query_lens": vcfg.get_decode_cudagraph_query_lens(vcfg.uniform_decode_query_len)}

    def query_len_reason(self) -> str:
        """Where the target's decode query length, which its uniform-decode graphs are keyed by, comes from."""
        return "VllmConfig.uniform_decode_query_len"

    def max_capture_tokens(self, cfg: VllmCheckConfig) -> int:
        """The user's max_cudagraph_capture_size."""
        return cfg.max_cudagraph_capture_size

    def piecewise_rule(self, runner: str, cfg: VllmCheckConfig) -> tuple[list[int], str]:
        """The token counts a runner's manager captures PIECEWISE (beside its FULL decode graphs), and why."""
        return [], "PIECEWISE graphs come from prefill_cudagraph_capture_token_sizes, configured empty"

    def flags(self, cfg: VllmCheckConfig) -> str:
        return (f"max_cudagraph_capture_size={cfg.max_cudagraph_capture_size} "
                f"decode_cudagraph_capture_request_sizes={list(cfg.decode_request_sizes)}")

    def rules(self, runner: str, q: int, cfg: VllmCheckConfig, vcfg: Strict) -> list[Rule]:
        limit = min(cfg.max_num_seqs, cfg.max_cudagraph_capture_size // q)
        if runner == "draft_decode":
            grid = vcfg.get_draft_decode_cudagraph_request_sizes()
            return [("draft decode request sizes", [n for n in grid if n <= limit], "the engine's draft-decode request grid, each captured once"),
                    (SMALLEST_LARGEST, (1, limit),
                     f"one-token draft decodes have graphs up to min(max_num_seqs, cap) = {limit} requests")]
        sizes = sorted(set(cfg.decode_request_sizes))
        want = [n for n in sizes if n < limit] + ([limit] if any(n >= limit for n in sizes) else [])
        return [("request sizes at 1 + K", want,
                 f"configured sizes below min(max_num_seqs, cap // (1 + K)) = {limit}, and that limit for the first size above it")]


class TokenKeyedApi(CaptureApi):
    """The token-keyed API (model runner v2 up to 0.33)."""

    name = "mrv2-tok"
    bound = ("uniform_decode_query_len",)

    def compilation(self, mode: Any, cfg: VllmCheckConfig) -> Strict:
        return Strict("compilation_config", cudagraph_mode=mode, cudagraph_capture_sizes=list(cfg.cudagraph_capture_sizes),
                      max_cudagraph_capture_size=max(cfg.cudagraph_capture_sizes), compile_sizes=None)

    def settle(self, vllm_config_cls: type, compilation_config_cls: type, vcfg: Strict) -> None:
        """VllmConfig._set_cudagraph_sizes (the release's own) settles the user's token sizes."""
        comp = vcfg.compilation_config
        object.__setattr__(comp, "post_init_cudagraph_sizes", compilation_config_cls.post_init_cudagraph_sizes.__get__(comp))
        vllm_config_cls._set_cudagraph_sizes(vcfg)

    def target_manager_kwargs(self, vcfg: Strict) -> dict[str, Any]:
        return {"decode_query_len": vcfg.uniform_decode_query_len}

    def max_capture_tokens(self, cfg: VllmCheckConfig) -> int:
        return max(cfg.cudagraph_capture_sizes)  # the two flags must agree (VllmConfig._set_cudagraph_sizes)

    def _sizes(self, cfg: VllmCheckConfig) -> list[int]:
        """The configured token sizes a batch can reach (within max_num_batched_tokens, as drive.py sets it)."""
        return sorted({t for t in cfg.cudagraph_capture_sizes if t <= cfg.max_num_seqs * (1 + cfg.num_speculative_tokens)})

    def piecewise_rule(self, runner: str, cfg: VllmCheckConfig) -> tuple[list[int], str]:
        if runner == "draft_decode":
            return [], "draft decodes run FULL_DECODE_ONLY: no PIECEWISE graphs"
        return self._sizes(cfg), "FULL_AND_PIECEWISE: every configured token size is also a PIECEWISE graph for batches no FULL graph holds"

    def flags(self, cfg: VllmCheckConfig) -> str:
        return f"max_cudagraph_capture_size={self.max_capture_tokens(cfg)} cudagraph_capture_sizes={list(cfg.cudagraph_capture_sizes)}"

    def rules(self, runner: str, q: int, cfg: VllmCheckConfig, vcfg: Strict) -> list[Rule]:
        sizes = self._sizes(cfg)
        cap = sizes[-1]
        want = sorted({_ceil_div(t, q) for t in sizes if _ceil_div(t, q) * q <= cap and _ceil_div(t, q) <= cfg.max_num_seqs})
        field = "draft decode request sizes" if runner == "draft_decode" else "request sizes at 1 + K"
        return [(field, want, f"each configured token size rounded up to a multiple of q = {q}, as requests, kept while within "
                              f"max_cudagraph_capture_size {cap} and max_num_seqs {cfg.max_num_seqs}")]


class RunnerQueryLenApi(TokenKeyedApi):
    """The token-keyed API before VllmConfig.uniform_decode_query_len: the target manager's decode_query_len is
    GPUModelRunner's, the release's own assignment evaluated here (module docstring)."""

    name = "mrv2-tkr"
    bound = ()
    # CudaGraphManager._init_candidates keyed the candidates by token count alone up to 0.28 (vllm/v1/worker/gpu/
    # cudagraph_utils.py, 0.28.0 lines 287-295): a 16-token PIECEWISE graph takes 12 tokens before an 18-token FULL
    # one; 0.29 groups them per mode. Both releases of this API (0.27, 0.28) have the old order.
    dispatch = DispatchOrder.SMALLEST_GRAPH
    # the model state a causal LM target (an EAGLE deployment's) gets from init_model_state: none of its special cases
    MODEL_STATE = ("vllm.v1.worker.gpu.model_states.default", "DefaultModelState")

    def __init__(self, runner_file: Path, version: str) -> None:
        self.version = version
        tree = ast.parse(runner_file.read_text())
        runner = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "GPUModelRunner"), None)
        if runner is None:
            raise EngineAdapterError(f"vllm {version}: {runner_file} has no GPUModelRunner; teach api.py its decode query length")
        # every `self.X = expr` of the model runner, X assigned once (the attributes the query length's assignment reads)
        assigned: dict[str, list[ast.Assign]] = {}
        for n in ast.walk(runner):
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and _dotted(n.targets[0]).startswith("self."):
                assigned.setdefault(_dotted(n.targets[0]), []).append(n)
        self.assigned = {k: v[0] for k, v in assigned.items() if len(v) == 1}
        if "self.decode_query_len" not in self.assigned:
            raise EngineAdapterError(f"vllm {version}: GPUModelRunner assigns self.decode_query_len {len(assigned.get('self.decode_query_len', []))} "
                                     "times; teach api.py its decode query length")
        node = self.assigned["self.decode_query_len"]
        self.where = f"vllm/v1/worker/gpu/model_runner.py:{node.lineno}: self.decode_query_len = {ast.unparse(node.value)}"
        self.model_state_cls: Optional[type] = None

    def decode_query_len(self, vcfg: Strict) -> int:
        return self._eval(self.assigned["self.decode_query_len"].value, vcfg)

    def _eval(self, node: ast.expr, vcfg: Strict) -> int:
        """The model runner's expression over what it reads: its own attributes (their assignments), its vllm_config (the
        stand-in) and its model state's class attributes. Anything else is a derivation not taught here."""
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            a, b = self._eval(node.left, vcfg), self._eval(node.right, vcfg)
            return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        name = _dotted(node)
        head, _, attr = name.rpartition(".")
        if head == "vllm_config":
            return getattr(vcfg, attr)
        if head == "self.model_state":
            return getattr(self._model_state(), attr)
        if name in self.assigned and name != "self.decode_query_len":
            return self._eval(self.assigned[name].value, vcfg)
        raise EngineAdapterError(f"vllm {self.version}: GPUModelRunner's decode query length ({self.where}) reads "
                                 f"{ast.unparse(node)}, which api.py cannot evaluate; teach it")

    def _model_state(self) -> type:
        if self.model_state_cls is None:
            module, cls = self.MODEL_STATE
            self.model_state_cls = getattr(importlib.import_module(module), cls)
        return self.model_state_cls

    def target_manager_kwargs(self, vcfg: Strict) -> dict[str, Any]:
        return {"decode_query_len": self.decode_query_len(vcfg)}

    def query_len_reason(self) -> str:
        return f"GPUModelRunner's own ({self.where}), evaluated over the configuration and {self.MODEL_STATE[1]}"


def _dotted(node: ast.expr) -> str:
    """`self.a.b` for an attribute chain; "" for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def capture_api(vllm_config_cls: type, manager_cls: Optional[type], version: str, graph_path: str) -> CaptureApi:
    """The API this release's configuration and managers speak; n/a when neither."""
    if hasattr(vllm_config_cls, "get_draft_decode_cudagraph_request_sizes"):
        return CaptureApi()
    params = inspect.signature(manager_cls.__init__).parameters if manager_cls is not None else {}
    if hasattr(vllm_config_cls, "_set_cudagraph_sizes") and "decode_query_len" in params:
        if hasattr(vllm_config_cls, "uniform_decode_query_len"):
            return TokenKeyedApi()
        spec = importlib.util.find_spec("vllm.v1.worker.gpu.model_runner")
        if spec is None or spec.origin is None:
            raise EngineAdapterError(f"vllm {version}: no vllm/v1/worker/gpu/model_runner.py, whose GPUModelRunner sets the target's "
                                     "decode query length; teach api.py where it went")
        return RunnerQueryLenApi(Path(spec.origin), version)
    raise ReleaseNotCovered(f"vllm {version} carries model runner v2's EAGLE speculator graph path ({graph_path}) with neither "
                            "request-keyed capture sizes (VllmConfig.get_draft_decode_cudagraph_request_sizes) nor the token-keyed "
                            "CudaGraphManager(decode_query_len=...) over VllmConfig._set_cudagraph_sizes")
