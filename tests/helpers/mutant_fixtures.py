"""Mutants for testing the mutant runner itself (importable by its child processes).

Each shrinks the metadata-grid probe to one attn-TP-gather layout so a child runs in
well under a second; the seed bug is then killed by P1 and the bare shrink survives.
"""
from __future__ import annotations

import os
import time

from harness import mutants
from harness.mutants import Mutant
from harness.props import p1
from runners.parallel.layout import ParallelLayout


def _one_layout() -> tuple[ParallelLayout, ...]:
    return (ParallelLayout(tp_size=2, moe_a2a_backend="deepep"),)


def _exit_child(*args, **kwargs):
    os._exit(3)  # the child dies without reporting, as a segfault in a kernel would


def _hang(*args, **kwargs):
    time.sleep(600)


def _raise(*args, **kwargs):
    raise RuntimeError("the harness itself broke")


SMALL_GRID = (p1, "all_layouts", _one_layout)
GRID = ("metadata-grid",)

CATALOG: tuple[Mutant, ...] = (
    Mutant("seed-bug", "sglang-26416 on a one-layout grid", "test", mutants.get("sglang-26416").patches + (SMALL_GRID,), GRID),
    Mutant("no-bug", "the one-layout grid alone: nothing to kill", "test", (SMALL_GRID,), GRID),
    Mutant("seed-bug-two-probes", "sglang-26416, the grid then P7", "test", mutants.get("sglang-26416").patches + (SMALL_GRID,),
           ("metadata-grid", "p7-idle-ranks")),
    Mutant("child-exits", "the probe's process exits", "test", ((p1, "check_metadata", _exit_child),), GRID),
    Mutant("child-hangs", "the probe never returns", "test", ((p1, "check_metadata", _hang),), GRID),
    Mutant("probe-raises", "the probe raises", "test", ((p1, "check_metadata", _raise),), GRID),
)
