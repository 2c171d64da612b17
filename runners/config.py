"""Model and speculative-decoding configs (nanoGPT-style dataclasses)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
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


class DraftKind(StrEnum):
    """Which EAGLE draft proposes (SGLang's speculative algorithm and its draft model).

    MULTI_LAYER: MTP, one draft layer per speculative step, the steps run as draft-extend. SINGLE_LAYER: one EAGLE
    layer run num_steps times (draft-extend, then the graphed draft decode). EAGLE3: SINGLE_LAYER's passes over an
    EAGLE3 draft: it reads auxiliary hidden states captured from several target layers (projected by its fc) and
    drafts over a reduced vocabulary mapped to target ids (runners.llama_eagle3).
    """

    MULTI_LAYER = "multi_layer"
    SINGLE_LAYER = "single_layer"
    EAGLE3 = "eagle3"

    @property
    def has_draft_decode(self) -> bool:
        """One draft layer, run num_steps times: the draft-extend gives depth 1, the draft decode the rest."""
        return self is not DraftKind.MULTI_LAYER

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
        raise ValueError(f"spec.{field_name}: one of {', '.join(cls)}, got {value!r}") from None


@dataclass(frozen=True)
class SpecConfig:
    """EAGLE/MTP speculative config: one draft layer per step (multi-layer EAGLE), or one layer run num_steps times.

    The draft's own checkpoint and placement, where they differ from the target's (None / empty: as the target):
    eagle_aux_hidden_state_layer_ids and draft_vocab_size (EAGLE3 only), draft_tp_size (runners.draft_parallel),
    draft_max_position_embeddings and draft_rope_theta (its rotary table: draft_model_config).
    """

    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int | None = None  # tokens per request in draft-extend; default num_steps + 1
    capture_bs: tuple[int, ...] = field(default_factory=lambda: tuple(default_capture_bs()))
    max_running_requests: int = 32
    page_size: int = 1  # KV slots per page of every rank's KV pools (a server arg, not part of the weights)
    draft: DraftKind = DraftKind.MULTI_LAYER  # a case file names it by value ("multi_layer", "single_layer", "eagle3")
    draft_extend_graph: DraftExtendGraph = DraftExtendGraph.PER_STEP  # the multi-layer draft-extend's graph composite
    # EAGLE3: the target layers whose outputs the draft reads, concatenated (SGLang's eagle_aux_hidden_state_layer_ids:
    # id i is layer i's output, captured at layer i + 1's input; -1 the embeddings)
    eagle_aux_hidden_state_layer_ids: tuple[int, ...] = ()
    draft_vocab_size: int | None = None  # EAGLE3: the draft's reduced vocabulary (its lm_head rows, its d2t table)
    draft_tp_size: int | None = None  # the draft's own TP size: 1 or the target's attn_tp_size (runners.draft_parallel)
    draft_max_position_embeddings: int | None = None  # the draft checkpoint's rotary rows (raised to the target's context)
    draft_rope_theta: float | None = None  # the draft checkpoint's rotary base
    # SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION: under DP attention one iteration may prefill on one DP group while
    # another verifies (runners.mixed_modes); off, a group's prefill and its verify run in passes of their own
    dp_spec_prefill_coordination: bool = False
    # spec v2's overlap scheduler: the next iteration is launched before the host reads this one's verify results
    # (runners.overlap); the draft's chain of tokens only (topk 1) and the multi-layer draft, as spec v2 began with
    overlap_schedule: bool = False

    padding_convention: PaddingConvention = PaddingConvention.SGLANG_DUMMY_SLOT  # what padded lanes write (every runner)
    draft_extend_shape: DraftExtendShape = DraftExtendShape.FIXED  # the multi-layer draft-extend's token layout
    cuda_graph_mode: CudaGraphMode = CudaGraphMode.FULL  # the multi-layer draft-extend's graphs

    def __post_init__(self) -> None:
        """A config written by hand or read from a file names each option by its value; a frozen dataclass keeps the
        enum. Messages name the field as a case file does (spec.<field>: the rule): the case loader reports them so."""
        try:
            draft = DraftKind(self.draft)
        except ValueError:
            raise ValueError(f"spec.draft: one of {', '.join(DraftKind)} (a layer per step, one layer with a graphed draft decode, or EAGLE3), "
                             f"got {self.draft!r}") from None
        graph = _as_enum(DraftExtendGraph, self.draft_extend_graph, "draft_extend_graph")
        if graph is DraftExtendGraph.ONE_GRAPH and draft is not DraftKind.MULTI_LAYER:
            raise ValueError(f"spec.draft_extend_graph: 'per_step' with the {draft.value} draft ({graph.value!r} needs the multi-layer draft: "
                             f"the {draft.value} draft-extend is one step)")
        object.__setattr__(self, "draft_extend_graph", graph)
        object.__setattr__(self, "draft", draft)
        object.__setattr__(self, "padding_convention", _as_enum(PaddingConvention, self.padding_convention, "padding_convention"))
        shape = _as_enum(DraftExtendShape, self.draft_extend_shape, "draft_extend_shape")
        mode = _as_enum(CudaGraphMode, self.cuda_graph_mode, "cuda_graph_mode")
        for name, value, default in (("draft_extend_shape", shape, DraftExtendShape.FIXED), ("cuda_graph_mode", mode, CudaGraphMode.FULL)):
            if value is default:
                continue
            if draft is not DraftKind.MULTI_LAYER or graph is not DraftExtendGraph.PER_STEP:
                raise ValueError(f"spec.{name}: the multi-layer draft with draft_extend_graph 'per_step' for {value.value!r} "
                                 f"(got draft {draft.value!r}, draft_extend_graph {graph.value!r})")
        if shape is DraftExtendShape.RAGGED and mode is CudaGraphMode.PIECEWISE:
            raise ValueError("spec.draft_extend_shape: 'fixed' with cuda_graph_mode 'piecewise' (the ragged runner is a FULL graph)")
        object.__setattr__(self, "draft_extend_shape", shape)
        object.__setattr__(self, "cuda_graph_mode", mode)
        layer_ids = tuple(self.eagle_aux_hidden_state_layer_ids)  # a case file's list
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in layer_ids):
            raise ValueError(f"spec.eagle_aux_hidden_state_layer_ids: integer target layer ids, got {list(layer_ids)}")
        object.__setattr__(self, "eagle_aux_hidden_state_layer_ids", layer_ids)
        # messages name the field as a case file does (spec.<field>: the rule): the case loader reports them so
        if draft is DraftKind.EAGLE3:
            if not layer_ids or len(set(layer_ids)) != len(layer_ids) or min(layer_ids) < -1:
                raise ValueError(f"spec.eagle_aux_hidden_state_layer_ids: distinct target layer ids >= -1, the layers the EAGLE3 draft reads "
                                 f"(layer i's output, -1 the embeddings), got {list(layer_ids)}")
        else:
            for name in ("eagle_aux_hidden_state_layer_ids", "draft_vocab_size"):
                if getattr(self, name):
                    raise ValueError(f"spec.{name}: only with draft = 'eagle3' (an EAGLE3 draft's setting), not with the {draft.value} draft")
        for name in ("draft_vocab_size", "draft_tp_size", "draft_max_position_embeddings"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"spec.{name}: an integer >= 1, got {value}")
        if self.draft_rope_theta is not None and not 0 < self.draft_rope_theta < 1e12:
            raise ValueError(f"spec.draft_rope_theta: a number > 0, got {self.draft_rope_theta}")
        if self.overlap_schedule and self.dp_spec_prefill_coordination:
            raise ValueError("spec.overlap_schedule: false with dp_spec_prefill_coordination (the two schedulers are not combined here)")
        if self.overlap_schedule and (self.topk != 1 or self.draft != "multi_layer"):
            raise ValueError(f"spec.overlap_schedule: false unless topk = 1 and draft = multi_layer (the overlapped verify accepts a chain "
                             f"on the device), not topk {self.topk}, draft {self.draft!r}")

    def check_layout(self, layout: ParallelLayout) -> None:
        """The rules that need the layout too (a ValueError "spec.<field>: rule", as __post_init__'s)."""
        if self.dp_spec_prefill_coordination and layout.attn_dp_size == 1:
            raise ValueError("spec.dp_spec_prefill_coordination: false without DP attention, dp_size > 1 (it mixes the DP groups' forward modes)")
        # the eager ragged pass counts no other DP group's tokens (its MLP sync would need every group's accepted-token
        # count), so the ragged shape runs without DP attention
        if self.draft_extend_shape is DraftExtendShape.RAGGED and layout.attn_dp_size > 1:
            raise ValueError(f"spec.draft_extend_shape: 'fixed' under DP attention (dp {layout.attn_dp_size}): the eager ragged pass is not MLP-synced")

    @property
    def num_tokens_per_bs(self) -> int:
        return self.num_draft_tokens if self.num_draft_tokens is not None else self.num_steps + 1

    @property
    def num_aux_hidden_states(self) -> int:
        """Target layers the EAGLE3 draft reads (0: the draft reads the target's last hidden state)."""
        return len(self.eagle_aux_hidden_state_layer_ids)

    def draft_fields(self) -> dict:
        """The draft's own settings that differ from the target's, by name: what a golden's identity adds to the spec
        (empty for a multi-layer or single-layer draft in the target's layout, so their goldens keep their identity)."""
        out: dict = {}
        if self.draft is DraftKind.EAGLE3:
            out.update(draft=self.draft.value, eagle_aux_hidden_state_layer_ids=list(self.eagle_aux_hidden_state_layer_ids),
                       draft_vocab_size=self.draft_vocab_size)
        for name in ("draft_tp_size", "draft_max_position_embeddings", "draft_rope_theta"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


def draft_input_hidden_size(cfg: ModelConfig, spec: SpecConfig) -> int:
    """Width of the target hidden states the draft reads (SGLang's get_draft_input_from_target_hidden_dim): the target's
    hidden size times the captured layers for EAGLE3, the hidden size for every other draft. What the draft-extend's and
    the target verify's hidden buffers are sized by; the draft decode carries the draft's own (hidden_size)."""
    return cfg.hidden_size * max(1, spec.num_aux_hidden_states)


def draft_model_config(cfg: ModelConfig, spec: SpecConfig) -> ModelConfig:
    """The draft's own ModelConfig: the target's sizes (the draft shares its embedding and hidden size), with the draft
    checkpoint's rotary base and max positions. A draft whose checkpoint has fewer positions than the target's context
    still sees every position the target does, so its rotary table is raised to the target's (vLLM's
    _maybe_override_draft_max_position_embeddings: a smaller cos_sin_cache is gathered out of bounds)."""
    own = spec.draft_max_position_embeddings
    return replace(cfg, max_context_len=max(cfg.max_context_len, own or 0),
                   rope_theta=cfg.rope_theta if spec.draft_rope_theta is None else spec.draft_rope_theta)


def check_spec_fits_model(cfg: ModelConfig, spec: SpecConfig) -> None:
    """What a spec asks of the target model; ValueError naming the field."""
    n = cfg.num_target_layers
    bad = [i for i in spec.eagle_aux_hidden_state_layer_ids if not -1 <= i <= n - 2]
    if bad:
        raise ValueError(f"spec.eagle_aux_hidden_state_layer_ids: ids in -1..{n - 2} (layer i's output is captured at layer i + 1's input, "
                         f"and the target has model.num_target_layers = {n}), got {bad}")
    if spec.draft_vocab_size is not None and spec.draft_vocab_size > cfg.vocab_size:
        raise ValueError(f"spec.draft_vocab_size: at most the target's model.vocab_size ({cfg.vocab_size}), got {spec.draft_vocab_size}")
