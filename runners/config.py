"""Model and speculative-decoding configs (nanoGPT-style dataclasses)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum

import torch

from runners.parallel.layout import ParallelLayout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the target and draft models. 8 query heads so TP 8 shards one head per rank."""

    hidden_size: int = 64
    num_heads: int = 8
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512
    num_target_layers: int = 2
    max_context_len: int = 64  # per request: prefix + draft-extend tokens
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    seed: int = 0
    dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def fingerprint(self) -> str:
        """Hash of everything that decides the weights: goldens refuse another model's."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def default_capture_bs() -> list[int]:
    """Like the engine's default list for a small server: 1, 2, 4, 8, then steps of 8."""
    return [1, 2, 4, 8, 16, 24, 32]


DEFAULT_MODEL = ModelConfig()  # frozen: one shared instance serves as every default


class DraftExtendGraph(StrEnum):
    """How the multi-layer draft-extend is graphed: SGLang's two composites (the single-layer draft has one step).

    PER_STEP: a graph per step per bucket; between steps the driver writes the chain (token ids, hidden states) into
    the shared buffers on the host. ONE_GRAPH: one graph per bucket holds every step and the chain between them
    (SGLang's default on FA3 from 0.5.16, SGLANG_ENABLE_SINGLE_CG_DRAFT): one replay per iteration.
    """

    PER_STEP = "per_step"
    ONE_GRAPH = "one_graph"

    def __repr__(self) -> str:
        """As code, so a config's repr (a failing example's @example line) rebuilds it."""
        return f"{type(self).__name__}.{self.name}"


@dataclass(frozen=True)
class SpecConfig:
    """EAGLE/MTP speculative config: one draft layer per step (multi-layer EAGLE), or one layer run num_steps times."""

    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int | None = None  # tokens per request in draft-extend; default num_steps + 1
    capture_bs: tuple[int, ...] = field(default_factory=lambda: tuple(default_capture_bs()))
    max_running_requests: int = 32
    page_size: int = 1  # KV slots per page of every rank's KV pools (a server arg, not part of the weights)
    draft: str = "multi_layer"  # EAGLE draft: "multi_layer" (MTP: a layer per step) or "single_layer" (one layer, graphed draft decode)
    draft_extend_graph: DraftExtendGraph = DraftExtendGraph.PER_STEP  # the multi-layer draft-extend's graph composite
    # SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION: under DP attention one iteration may prefill on one DP group while
    # another verifies (runners.mixed_modes); off, a group's prefill and its verify run in passes of their own
    dp_spec_prefill_coordination: bool = False
    # spec v2's overlap scheduler: the next iteration is launched before the host reads this one's verify results
    # (runners.overlap); the draft's chain of tokens only (topk 1) and the multi-layer draft, as spec v2 began with
    overlap_schedule: bool = False

    def __post_init__(self) -> None:
        """A config written by hand or read from a file names the composite by its value; a frozen dataclass keeps the enum."""
        try:
            graph = DraftExtendGraph(self.draft_extend_graph)
        except ValueError:
            raise ValueError(f"draft_extend_graph must be one of {', '.join(DraftExtendGraph)}, got {self.draft_extend_graph!r}") from None
        if graph is DraftExtendGraph.ONE_GRAPH and self.draft != "multi_layer":
            raise ValueError(f"draft_extend_graph {graph.value!r} needs the multi-layer draft (the single-layer draft-extend is one step)")
        object.__setattr__(self, "draft_extend_graph", graph)
        if self.overlap_schedule and self.dp_spec_prefill_coordination:
            raise ValueError("overlap_schedule: false with dp_spec_prefill_coordination (the two schedulers are not combined here)")
        if self.overlap_schedule and (self.topk != 1 or self.draft != "multi_layer"):
            raise ValueError(f"overlap_schedule: false unless topk = 1 and draft = multi_layer (the overlapped verify accepts a chain "
                             f"on the device), not topk {self.topk}, draft {self.draft!r}")

    def check_layout(self, layout: ParallelLayout) -> None:
        """The rules that need the layout too (a ValueError "field: rule", as __post_init__'s)."""
        if self.dp_spec_prefill_coordination and layout.attn_dp_size == 1:
            raise ValueError("dp_spec_prefill_coordination: false without DP attention, dp_size > 1 (it mixes the DP groups' forward modes)")

    @property
    def num_tokens_per_bs(self) -> int:
        return self.num_draft_tokens if self.num_draft_tokens is not None else self.num_steps + 1
