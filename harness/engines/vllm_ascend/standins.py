"""Stand-ins for what vllm-ascend's proposer reads but a CPU check cannot give: the configuration, the model runner's
state, the draft model, the target model it shares weights with.

The configuration is strict (reading an attribute it lacks names it: a release that moved
something ends with exit 2) and its derived values are the engine's own: the compilation
config settles the user's capture sizes with vLLM's resolve_cudagraph_mode_and_sizes, bound
to it, and the ascend config is the release's AscendConfig built from it.

The model runner is the state the proposer reads (its persistent buffers, the block table,
the dispatcher) plus three of NPUModelRunner's methods compiled from the release's source
(loader.py). The draft model is one EAGLE layer around the release's own attention backend
(AscendAttentionBackendImpl, metadata builder, KV write): its query and key are the token id
and position each row read, and its hidden state is the token id, so the draft it emits (the
id after the one read: compute_logits) tells which inputs each draft step's forward was given.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from harness.engines.drive import Strict as BaseStrict
from harness.engines.vllm_ascend.config import AscendCheckConfig, GraphMode, World

DRAFT_LAYER = "draft_model.layers.0.self_attn.attn"  # the draft's one attention layer
TARGET_LAYER = "model.layers.0.self_attn.attn"  # the target's (its KV group is the draft's: one group)
# the platform's default KV block (refresh_block_size, utils.py:1380-1381), the one kernel block size AscendAttentionBackend
# supports (get_supported_kernel_block_sizes): the draft's slot mappings are computed with either, depending on the release
KV_BLOCK_SIZE = 128
NUM_KV_BLOCKS = 160  # the block-table rows use blocks 100 .. 131 (runner.py)
HEAD_SIZE = 2  # a key row is (token id, position): what the KV cache holds tells who wrote a slot
VOCAB = 4096  # token ids the check uses stay below it (drive.py)


class Strict(BaseStrict):
    engine = "vllm-ascend"
    where = "harness/engines/vllm_ascend/standins.py"


def compilation_config(engine: Any, cfg: AscendCheckConfig, mode: GraphMode) -> Strict:
    """The compilation config a user's flags give, its capture sizes settled by vLLM's own rule."""
    comp_mod = engine.modules["compilation"]
    cls = comp_mod.CompilationConfig
    sizes = sorted(cfg.cudagraph_capture_sizes)
    comp = Strict("compilation_config", cudagraph_mode=getattr(comp_mod.CUDAGraphMode, mode.value),
                  mode=comp_mod.CompilationMode.VLLM_COMPILE, cudagraph_capture_sizes=sizes, max_cudagraph_capture_size=sizes[-1],
                  compile_sizes=[], cudagraph_specialize_lora=False, static_forward_context={}, static_all_moe_layers=[],
                  fast_moe_cold_start=False, splitting_ops=[], use_inductor_graph_partition=False, cudagraph_num_of_warmups=1,
                  pass_config=Strict("pass_config", enable_sp=False))
    for name in ("resolve_cudagraph_mode_and_sizes", "adjust_cudagraph_sizes_for_spec_decode", "is_attention_compiled_piecewise",
                 "splitting_ops_contain_attention"):
        object.__setattr__(comp, name, getattr(cls, name).__get__(comp))
    return comp


def vllm_config(engine: Any, cfg: AscendCheckConfig, world: World, dp_rank: int) -> Strict:
    q = 1 + cfg.num_speculative_tokens
    experts = {"num_experts": 8} if world.moe else {}  # vllm-ascend tells a MoE model by an "expert" key in its config
    hf = _hf_config("hf_config", model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=1, **experts)
    draft_hf = _hf_config("draft_hf_config", model_type="eagle", architectures=["EagleLlamaForCausalLM"], num_hidden_layers=1, **experts)
    model = Strict("model_config", max_model_len=cfg.max_model_len, dtype=torch.float32, hf_config=hf, hf_text_config=hf,
                   is_multimodal_model=False, uses_mrope=False, uses_xdrope_dim=0, use_mla=False, enforce_eager=False,
                   use_fp64_gumbel=False, runner_type="generate", is_deepseek_mla=False, is_hybrid=False,
                   get_hidden_size=lambda: 1, get_inputs_embeds_size=lambda: 1)
    draft_model = Strict("draft_model_config", hf_config=draft_hf, hf_text_config=draft_hf, uses_mrope=False, uses_xdrope_dim=0,
                         get_hidden_size=lambda: 1, get_inputs_embeds_size=lambda: 1, max_model_len=cfg.max_model_len)
    spec = Strict("speculative_config", method="eagle", num_speculative_tokens=cfg.num_speculative_tokens, draft_model_config=draft_model,
                  parallel_drafting=False, use_local_argmax_reduction=False, use_heterogeneous_vocab=False,
                  disable_padded_drafter_batch=False, enforce_eager=False,
                  draft_tensor_parallel_size=1, rejection_sample_method="standard", draft_sample_method="greedy",
                  use_eagle=lambda: True, uses_draft_model=lambda: False, uses_extract_hidden_states=lambda: False)
    return Strict(
        "vllm_config", num_speculative_tokens=cfg.num_speculative_tokens, model_config=model, speculative_config=spec,
        compilation_config=compilation_config(engine, cfg, world.mode),
        scheduler_config=Strict("scheduler_config", max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_seqs * q,
                                async_scheduling=False, enable_chunked_prefill=True),
        parallel_config=Strict("parallel_config", tensor_parallel_size=1, data_parallel_size=world.dp, data_parallel_rank=dp_rank,
                               pipeline_parallel_size=1, prefill_context_parallel_size=1, decode_context_parallel_size=1,
                               is_moe_model=world.moe, enable_expert_parallel=False,
                               use_sequence_parallel_moe=False),
        cache_config=Strict("cache_config", block_size=KV_BLOCK_SIZE, cache_dtype="auto"),
        additional_config={}, kv_transfer_config=None, lora_config=None, quant_config=None, use_v2_model_runner=False,
    )


def _hf_config(name: str, **fields: Any) -> Strict:
    return Strict(name, to_dict=lambda: dict(fields), **fields)


class _DraftAttention(nn.Module):
    """The draft's attention layer: the release's backend, its KV cache, registered as vLLM's Attention layers are (an
    AttentionLayerBase of the engine's: draft_attention builds the class)."""

    def __init__(self, engine: Any, name: str) -> None:
        super().__init__()
        self.engine = engine
        self.layer_name = name
        self.impl = _backend_impl(engine)
        self.kv_cache = torch.zeros(2, NUM_KV_BLOCKS, KV_BLOCK_SIZE, 1, HEAD_SIZE)
        self._k_scale_float = 1.0
        self._v_scale_float = 1.0

    def get_attn_backend(self) -> Any:
        return self.engine.modules["attention"].AscendAttentionBackend

    def get_kv_cache_spec(self, vllm_config: Any) -> Any:
        return kv_cache_spec(self.engine)

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        md = self.engine.modules["vllm_forward_context"].get_forward_context().attn_metadata
        md = md.get(self.layer_name) if isinstance(md, dict) else None
        out = torch.zeros_like(qkv)
        return self.impl.forward(self, qkv, qkv.clone(), qkv.clone(), self.kv_cache, md, out)


def draft_attention(engine: Any, name: str) -> _DraftAttention:
    base = engine.modules["attention_layer_base"].AttentionLayerBase
    cls = type("DraftAttention", (_DraftAttention, base), {})
    return cls(engine, name)


def kv_cache_spec(engine: Any) -> Any:
    return engine.modules["kv_cache_interface"].FullAttentionSpec(block_size=KV_BLOCK_SIZE, num_kv_heads=1, head_size=HEAD_SIZE,
                                                                    dtype=torch.float32)


def _backend_impl(engine: Any) -> Any:
    """AscendAttentionBackendImpl, built by its own __init__ (which reads the current config: drive.py sets it)."""
    impl_cls = engine.modules["attention"].AscendAttentionBackend.get_impl_cls()
    return impl_cls(num_heads=1, head_size=HEAD_SIZE, scale=1.0, num_kv_heads=1, alibi_slopes=None, sliding_window=None,
                        kv_cache_dtype="auto", logits_soft_cap=None, attn_type="decoder", kv_sharing_target_layer_name=None)


class DraftModel(nn.Module):
    """The EAGLE draft: one attention layer; hidden state = the token id each row read (see the module docstring)."""

    def __init__(self, attention: _DraftAttention) -> None:
        super().__init__()
        self.attn = attention
        self.has_own_embed_tokens = True
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(1, 1)
        self.calls: list[dict[str, Any]] = []  # every forward: the rows it read

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: Any = None,
                hidden_states: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append({"input_ids": input_ids.tolist(), "positions": positions.tolist()})
        qkv = torch.stack([input_ids.to(torch.float32), positions.to(torch.float32)], dim=-1).view(-1, 1, HEAD_SIZE)
        self.attn(qkv)  # its KV write and attention launch are what the check reads; its output is not
        hidden = input_ids.to(torch.float32).view(-1, 1)
        return hidden, hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """One-hot logits at the id after the one read: the sampled draft is the next id."""
        ids = (hidden_states[:, 0].round().to(torch.int64) + 1) % VOCAB
        return torch.nn.functional.one_hot(ids, VOCAB).to(torch.float32)


def target_model() -> nn.Module:
    """What load_model reads of the target: its embedding and lm_head (an EAGLE draft keeps its own, distinct)."""
    m = nn.Module()
    m.model = nn.Module()
    m.model.embed_tokens = nn.Embedding(2, 1)
    m.lm_head = nn.Linear(1, 1)
    return m


def cpu_gpu_buffer(engine: Any, n: int, dtype: torch.dtype) -> Any:
    return engine.modules["vllm_utils"].CpuGpuBuffer(n, dtype=dtype, device=torch.device("cpu"), pin_memory=False, with_numpy=True)
