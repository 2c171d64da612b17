"""The built-in mutant catalog: named, reversible patches of one behaviour each.

A mutant never edits a file: it monkeypatches one method or function of `runners` for
the duration of a `with mutant.planted():` block. `harness mutants` plants each one in
a child process, runs the probes that can see it (`probes`, ids from harness.pipeline.mutants.probes())
and reports which property killed it. A list starts with the cheapest probe of one run that kills its
mutant (by the CPU `harness mutants --json` reports per probe), then holds every probe that fails with
the mutant planted (a probe made of parts stands for its parts), and the comment beside it says which
properties fail; `harness mutants --all-probes --all-properties --only ID` re-derives it. A property
that cannot kill any mutant is not shown to work; a mutant no property kills is a hole.
"""
from __future__ import annotations

import difflib
from functools import cache
from typing import Any

from harness.mutants.base import Mutant, Wrap


@cache
def _catalog() -> tuple[Mutant, ...]:
    # The families import the runners (and torch): imported when the catalog is first asked for, so the rank launcher
    # and the CLI, which import harness.mutants.base for the planted ids, start without them.
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

    # one module per family, in the order `harness mutants` lists them
    catalog = (
        *draft_extend.MUTANTS, *spec_loop.MUTANTS, *memory.MUTANTS, *verify_fill.MUTANTS, *recorded_graph.MUTANTS,
        *decode.MUTANTS, *draft_attention.MUTANTS, *shape.MUTANTS, *verify.MUTANTS, *dp.MUTANTS, *host_mirror.MUTANTS,
        *replay_fill.MUTANTS, *padding_rule.MUTANTS, *fused_fill.MUTANTS, *sharding.MUTANTS,
        *one_graph.MUTANTS, *eagle3.MUTANTS, *draft_parallel.MUTANTS, *logprobs.MUTANTS, *mixed_modes.MUTANTS, *overlap.MUTANTS,
        *vllm_shapes.MUTANTS, *host_planned.MUTANTS, *triton_kernel.MUTANTS, *kept_views.MUTANTS, *capture_fields.MUTANTS,
    )
    ids = [m.id for m in catalog]
    if len(set(ids)) != len(ids):
        raise ImportError("two mutants share an id: " + ", ".join(sorted({i for i in ids if ids.count(i) > 1})))
    return catalog


@cache
def _by_id() -> dict[str, Mutant]:
    return {m.id: m for m in _catalog()}


CATALOG: tuple[Mutant, ...]
"""Every built-in mutant, one module per family, in the order `harness mutants` reports them (`harness.MUTANTS`)."""
BY_ID: dict[str, Mutant]


def __getattr__(name: str) -> Any:
    """CATALOG and BY_ID, built on first use (PEP 562)."""
    if name == "CATALOG":
        return _catalog()
    if name == "BY_ID":
        return _by_id()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get(mutant_id: str) -> Mutant:
    """The catalog's mutant with this id. An unknown id is a KeyError naming the closest ids, never the whole catalog
    (the CLI and the plugin turn it into a usage error)."""
    by_id = _by_id()
    if mutant_id not in by_id:
        close = difflib.get_close_matches(mutant_id, list(by_id), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise KeyError(f"unknown mutant {mutant_id!r}{hint} (`harness mutants --list` lists the {len(by_id)} ids)")
    return by_id[mutant_id]


__all__ = ["BY_ID", "CATALOG", "Mutant", "Wrap", "get"]
