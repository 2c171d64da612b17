"""Eager or graph: whether a runner runs its step body directly or replays a captured graph of it."""
from __future__ import annotations

from enum import StrEnum


class GraphMode(StrEnum):
    EAGER = "eager"  # the step body runs every time: the reference
    GRAPH = "graph"  # captured once per batch-size bucket, then replayed with the replay fill
