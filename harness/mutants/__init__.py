"""The built-in mutant catalog: named, reversible patches of one behaviour each.

A mutant never edits a file: it monkeypatches one method or function of `runners` for
the duration of a `with mutant.planted():` block. `harness mutants` plants each one in
a child process, runs the probes that can see it (`probes`, ids from harness.pipeline.mutants.probes(),
cheapest first; unset: every probe) and reports which property killed it. A list holds
every probe that fails with the mutant planted, and the comment beside it which properties
fail; `harness mutants --all-probes --all-properties --only ID` re-derives it. A property that cannot
kill any mutant is not shown to work; a mutant no property kills is a hole.
"""
from __future__ import annotations

import difflib

from harness.mutants import (
    capture_fields,
    decode,
    dp,
    draft_attention,
    draft_extend,
    draft_parallel,
    eagle3,
    fused_fill,
    host_mirror,
    host_planned,
    kept_views,
    logprobs,
    memory,
    mixed_modes,
    one_graph,
    overlap,
    padding_rule,
    recorded_graph,
    replay_fill,
    shape,
    sharding,
    spec_loop,
    triton_kernel,
    verify,
    verify_fill,
    vllm_shapes,
)
from harness.mutants.base import Mutant, Wrap

# one module per family, in the order `harness mutants` lists them
CATALOG: tuple[Mutant, ...] = (
    *draft_extend.MUTANTS, *spec_loop.MUTANTS, *memory.MUTANTS, *verify_fill.MUTANTS, *recorded_graph.MUTANTS,
    *decode.MUTANTS, *draft_attention.MUTANTS, *shape.MUTANTS, *verify.MUTANTS, *dp.MUTANTS, *host_mirror.MUTANTS,
    *replay_fill.MUTANTS, *padding_rule.MUTANTS, *fused_fill.MUTANTS, *sharding.MUTANTS,
    *one_graph.MUTANTS, *eagle3.MUTANTS, *draft_parallel.MUTANTS, *logprobs.MUTANTS, *mixed_modes.MUTANTS, *overlap.MUTANTS, *vllm_shapes.MUTANTS, *host_planned.MUTANTS, *triton_kernel.MUTANTS,
    *kept_views.MUTANTS, *capture_fields.MUTANTS,
)
"""Every built-in mutant, one module per family, in the order `harness mutants` reports them (`harness.MUTANTS`)."""
BY_ID: dict[str, Mutant] = {m.id: m for m in CATALOG}
if len(BY_ID) != len(CATALOG):
    raise ImportError("two mutants share an id: " + ", ".join(sorted({m.id for m in CATALOG if sum(x.id == m.id for x in CATALOG) > 1})))


def get(mutant_id: str) -> Mutant:
    """The catalog's mutant with this id. An unknown id is a KeyError naming the closest ids, never the whole catalog
    (the CLI and the plugin turn it into a usage error)."""
    if mutant_id not in BY_ID:
        close = difflib.get_close_matches(mutant_id, list(BY_ID), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise KeyError(f"unknown mutant {mutant_id!r}{hint} (`harness mutants --list` lists the {len(BY_ID)} ids)")
    return BY_ID[mutant_id]


__all__ = ["BY_ID", "CATALOG", "Mutant", "Wrap", "get"]
