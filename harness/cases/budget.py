"""The resource budget of a case: what one `harness check` of it may ask of the machine.

Simulated ranks are threads of one process, so the whole world's weights and KV pools share one
address space; a case the machine cannot hold must be refused when it is loaded, naming the
estimate, and not die mid-run as an allocation failure that reads like a property failure.
"""
from __future__ import annotations

import os
from typing import Optional

from runners.config import ModelConfig, SpecConfig
from runners.parallel.layout import ParallelLayout

MAX_ITERATIONS = 64  # each iteration runs every draft step on every rank, eager and graph, plus the oracle
MEMORY_BUDGET_ENV = "SPECHARNESS_MEMORY_BUDGET_GIB"
DEFAULT_MEMORY_BUDGET_GIB = 4.0
KV_SLOTS = 4096  # one rank's KV pool (runners/draft_extend.py DraftWorker num_slots)


def memory_budget_bytes() -> int:
    """$SPECHARNESS_MEMORY_BUDGET_GIB (a machine with more memory raises it), else 4 GiB."""
    try:
        gib = float(os.environ.get(MEMORY_BUDGET_ENV) or DEFAULT_MEMORY_BUDGET_GIB)
    except ValueError:
        gib = DEFAULT_MEMORY_BUDGET_GIB
    return int(gib * (1 << 30))


def estimate_bytes(model: ModelConfig, layout: ParallelLayout, spec: SpecConfig) -> int:
    """An upper estimate of what checking the case holds at once: per worker the full draft and target
    weights (each rank builds full fp32 weights before sharding) and a KV pool of every layer; one
    eager and one graph worker per rank, plus the TP1 oracle. Activations are small beside these."""
    H, inter, V, d = model.hidden_size, model.intermediate_size, model.vocab_size, model.head_dim
    layer = H * model.num_heads * d * 2 + H * model.num_kv_heads * d * 2 + 3 * H * inter
    draft = 2 * V * H + spec.num_steps * (2 * H * H + layer)
    target = 2 * V * H + model.num_target_layers * layer
    kv = KV_SLOTS * (spec.num_steps + model.num_target_layers) * model.num_kv_heads * d * 2
    return 4 * (draft + target + kv) * (2 * layout.world_size + 1)


def over_budget(model: ModelConfig, layout: ParallelLayout, spec: SpecConfig) -> Optional[tuple[str, str]]:
    """None within the budget, else (what was expected, what the case asks) for the error message."""
    need, budget = estimate_bytes(model, layout, spec), memory_budget_bytes()
    if need <= budget:
        return None
    gib = lambda b: f"{b / (1 << 30):.3g} GiB"  # noqa: E731
    return (f"a model whose weights and KV pools fit the memory budget of {gib(budget)} (${MEMORY_BUDGET_ENV})",
            f"an estimate of {gib(need)} for hidden_size {model.hidden_size}, vocab_size {model.vocab_size}, "
            f"intermediate_size {model.intermediate_size}, {spec.num_steps} draft + {model.num_target_layers} target "
            f"layers on {layout.world_size} rank(s) x 2 runners + the TP1 oracle")
