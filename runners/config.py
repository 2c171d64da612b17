"""Model and speculative-decoding configs (nanoGPT-style dataclasses)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum

import torch

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


class PaddingConvention(StrEnum):
    """What a padded graph lane writes: the two engines' conventions (runners.memory holds their values).

    SGLANG_DUMMY_SLOT: request row 0 is reserved as the padding row (every entry the dummy slot, slot 0); a padded lane
    is given row 0, so its in-graph KV write lands in the dummy slot, written and never read by a live row.
    VLLM_PAD_MINUS_ONE: no request row is reserved (every row may be a live request's, as vLLM's request states); a
    padded lane is given the pad request index -1, its write slot is PAD_SLOT_ID (-1) and every KV write skips it;
    slot 0 stays the null slot that padded lanes read (vLLM's null block) and nothing writes.
    """

    SGLANG_DUMMY_SLOT = "sglang_dummy_slot"
    VLLM_PAD_MINUS_ONE = "vllm_pad_minus_one"

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class DraftExtendShape(StrEnum):
    """How the multi-layer draft-extend lays its tokens out.

    FIXED: SGLang's DRAFT_EXTEND_V2, num_tokens_per_bs tokens per request whether accepted or not; each request selects
    its row by its accept length inside the graph. RAGGED: each request contributes its accepted tokens only, packed
    back to back (runners.ragged_draft_extend), and the row of each request's last token comes from a per-request gather
    index kept in a persistent buffer (vLLM's last_token_indices) that every replay rewrites, padded lanes included.
    """

    FIXED = "fixed"
    RAGGED = "ragged"

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class CudaGraphMode(StrEnum):
    """vLLM's CUDAGraphMode for the draft-extend graphs. FULL: the whole step body in one graph per bucket (every
    runner here). PIECEWISE: the dense parts captured per token-count bucket, the graph broken at attention, which runs
    eagerly on the live requests' metadata (runners.piecewise_draft_extend_cuda_graph_runner)."""

    FULL = "full"
    PIECEWISE = "piecewise"

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


# SpecConfig's fields that name an option by its value (a case file's spec.<key>)
SPEC_OPTIONS: dict[str, type[StrEnum]] = {"draft_extend_graph": DraftExtendGraph, "padding_convention": PaddingConvention,
                                          "draft_extend_shape": DraftExtendShape, "cuda_graph_mode": CudaGraphMode}


def _as_enum(cls: type[StrEnum], value: object, field_name: str) -> StrEnum:
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{field_name}: one of {', '.join(cls)}, got {value!r}") from None


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
    padding_convention: PaddingConvention = PaddingConvention.SGLANG_DUMMY_SLOT  # what padded lanes write (every runner)
    draft_extend_shape: DraftExtendShape = DraftExtendShape.FIXED  # the multi-layer draft-extend's token layout
    cuda_graph_mode: CudaGraphMode = CudaGraphMode.FULL  # the multi-layer draft-extend's graphs

    def __post_init__(self) -> None:
        """A config written by hand or read from a file names each option by its value; a frozen dataclass keeps the enum."""
        graph = _as_enum(DraftExtendGraph, self.draft_extend_graph, "draft_extend_graph")
        if graph is DraftExtendGraph.ONE_GRAPH and self.draft != "multi_layer":
            raise ValueError(f"draft_extend_graph {graph.value!r} needs the multi-layer draft (the single-layer draft-extend is one step)")
        object.__setattr__(self, "draft_extend_graph", graph)
        object.__setattr__(self, "padding_convention", _as_enum(PaddingConvention, self.padding_convention, "padding_convention"))
        shape = _as_enum(DraftExtendShape, self.draft_extend_shape, "draft_extend_shape")
        mode = _as_enum(CudaGraphMode, self.cuda_graph_mode, "cuda_graph_mode")
        for name, value, default in (("draft_extend_shape", shape, DraftExtendShape.FIXED), ("cuda_graph_mode", mode, CudaGraphMode.FULL)):
            if value is default:
                continue
            if self.draft != "multi_layer" or graph is not DraftExtendGraph.PER_STEP:
                raise ValueError(f"{name}: the multi-layer draft with draft_extend_graph 'per_step' for {value.value!r} "
                                 f"(got draft {self.draft!r}, draft_extend_graph {graph.value!r})")
        if shape is DraftExtendShape.RAGGED and mode is CudaGraphMode.PIECEWISE:
            raise ValueError("draft_extend_shape: 'fixed' with cuda_graph_mode 'piecewise' (the ragged runner is a FULL graph)")
        object.__setattr__(self, "draft_extend_shape", shape)
        object.__setattr__(self, "cuda_graph_mode", mode)

    def check_layout(self, attn_dp_size: int) -> None:
        """The options a layout excludes: the eager ragged pass counts no other DP group's tokens (its MLP sync would
        need every group's accepted-token count), so the ragged shape runs without DP attention."""
        if self.draft_extend_shape is DraftExtendShape.RAGGED and attn_dp_size > 1:
            raise ValueError(f"draft_extend_shape: 'fixed' under DP attention (dp {attn_dp_size}): the eager ragged pass is not MLP-synced")

    @property
    def num_tokens_per_bs(self) -> int:
        return self.num_draft_tokens if self.num_draft_tokens is not None else self.num_steps + 1
