"""Options shared by several commands; those that name one of a fixed set (ranks kind, graph mode) are parsed into
their enum once, where the user types them."""
from __future__ import annotations

import argparse
from enum import StrEnum
from typing import Callable

from harness.ranks.kinds import RanksKind
from runners.graph.mode import GraphMode


def enum_option(cls: type[StrEnum], *extra: str) -> Callable[[str], object]:
    """An argparse `type` giving cls(value) (or one of the `extra` plain values), refusing anything else
    with the allowed values named; its `choices_text` is the metavar."""
    allowed = [m.value for m in cls] + list(extra)

    def parse(value: str):
        if value in extra:
            return value
        try:
            return cls(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(allowed)}, got {value!r}") from None

    parse.__name__ = cls.__name__
    parse.choices_text = "{" + ",".join(allowed) + "}"  # type: ignore[attr-defined]
    return parse


RANKS_OPTION = enum_option(RanksKind)
RUNNER_OPTION = enum_option(GraphMode, "both")  # both: eager vs graph (P3)


def add_ranks(s: argparse.ArgumentParser) -> None:
    s.add_argument("--ranks", type=RANKS_OPTION, metavar=RANKS_OPTION.choices_text, default=RanksKind.SIM,
                   help="simulated ranks (threads), or real ones: a process per rank over gloo (CPU) or nccl (a GPU per rank)")
