"""Mutants of the loop's consumers of graph outputs: a view of a replay's outputs kept past the engine step that
produced it (runners.outputs: the next replay overwrites it). A property that reads right after the step (P8)
sees the right values; the harness poisons every graph output after each step (harness.run.kept_outputs), so a
kept view reads the poison there."""
from __future__ import annotations

from harness.mutants.base import Mutant
from runners.draft_decode import EagleProposer
from runners.spec_decode import SpecEngine, StepReport

_REAL_VERIFY = SpecEngine.verify


def _report_keeps_extend_views(self: SpecEngine, batch, rep: StepReport, sync=None) -> None:
    _REAL_VERIFY(self, batch, rep, sync)
    if rep.extend_outs and isinstance(self.draft, EagleProposer):
        rep.extend_outs = list(self.draft.last_outs)  # the replay's outputs as handed back: views, not copies


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "loop-report-keeps-extend-views",
        "the loop's step report keeps the draft-extend outputs as the replay handed them back (views of the graph's "
        "outputs) instead of copies: right after the step they hold the right values, but the report outlives the step "
        "and the next replay overwrites them",
        "graph output read after the next replay",
        ((SpecEngine, "verify", _report_keeps_extend_views),),
        ("churn-single-layer", "batch-churn"),  # P8 (the report's draft-extend outputs read the poisoned graph outputs)
    ),
)
