"""What a property is: one registered object.

A module of harness/props/ that defines a `Property` registers it (harness.props.registry finds it): its id and title
(what `harness explain` and the docs list), what it needs from a case (the pipeline builds that once and shares it),
its check over one case, and the probes `harness mutants` runs to show it bites. Nothing else names a property:
`harness check`, `harness replay`, the pytest plugin, the mutant runner and the docs iterate the registry.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Flag, auto
from typing import Callable, Optional, Sequence

from harness.run.case_run import CaseRun
from harness.run.crash import guarded
from harness.run.loop import spec_skip_reason
from harness.verdict import Verdict, merge_verdicts

Verdicts = dict[str, Verdict]  # property id -> verdict; a check or probe may report other properties' too (and "run")


class Needs(Flag):
    METADATA = auto()  # our graph runners driven without a model, one rank per DP group (no run)
    CASE_RUN = auto()  # one run of the case's draft-extend runners on its layout and ranks (CaseRun.runs)
    BOTH_RUNNERS = auto()  # that run with eager and graph side by side
    ORACLE = auto()  # the TP1 eager run of the same requests (CaseRun.oracle)
    LOOP = auto()  # the case's workload through the speculative decoding loop (simulated ranks only)
    SCHEDULES = auto()  # planned schedules of its own, no case: pytest and `harness mutants` run it
    REAL_RANKS = auto()  # a process per rank (torch.distributed): pytest runs it


ONE_RUN = Needs.METADATA | Needs.CASE_RUN | Needs.BOTH_RUNNERS | Needs.ORACLE  # `harness check`'s default, and what replay shows


@dataclass(frozen=True)
class Invariant:
    id: str  # I1 ... I7: `harness explain I3`
    title: str


@dataclass(frozen=True)
class Probe:
    """A few seconds of a property for `harness mutants`: a planted mutant is killed when a probe's verdict fails. A probe
    may report other properties' verdicts too (and "run" for a rank that failed); one that raises is an error of the
    mutant run, never a kill."""

    id: str
    run: Callable[[], Verdicts]
    costly: bool = False  # whole cases: a mutant without a probe list runs it after every other
    parts: tuple["Probe", ...] = ()  # a probe made of others (Probe.of): `run` runs them all in turn

    @classmethod
    def guarded(cls, probe_id: str, run: Callable[[], Verdicts]) -> "Probe":
        """A probe whose exception (a rank's, an oracle's, the harness') is a "run" failure naming it
        (harness.run.crash.guarded): a crash the mutant provokes is what the probe saw."""
        return cls(probe_id, guarded(probe_id, run))

    @classmethod
    def of(cls, probe_id: str, parts: Sequence["Probe"], costly: bool = False) -> "Probe":
        """A probe that is its parts run in turn, their verdicts merged. Each part is a probe of its own, so a mutant
        names the one part that sees it; a mutant that names the whole is run part by part by `harness mutants`, which
        stops at the first part that kills it."""
        if not parts:
            raise ValueError(f"probe {probe_id}: no parts")

        def run() -> Verdicts:
            out: Verdicts = {}
            for part in parts:
                merge_verdicts(out, part.run())
            return out

        return cls(probe_id, run, costly, tuple(parts))

    def leaves(self) -> tuple["Probe", ...]:
        """The probes that run: itself, or its parts' leaves in order."""
        return tuple(leaf for part in self.parts for leaf in part.leaves()) if self.parts else (self,)

    def flat(self) -> tuple["Probe", ...]:
        """Itself, then every part at every depth: every probe a mutant can name through this one."""
        return (self,) + tuple(p for part in self.parts for p in part.flat())


@dataclass(frozen=True)
class Property:
    id: str
    title: str
    needs: Needs
    check: Optional[Callable[[CaseRun], Verdicts]] = None  # one case; None: the property has runs of its own (SCHEDULES, REAL_RANKS)
    probes: tuple[Probe, ...] = ()
    invariants: tuple[Invariant, ...] = ()
    runs_under: str = ""  # where a property without a case check runs (said by `--props` and the docs)

    def __post_init__(self) -> None:
        per_case = not self.needs & (Needs.SCHEDULES | Needs.REAL_RANKS)
        if per_case != (self.check is not None):
            raise TypeError(f"property {self.id}: a check over one case exactly when it needs a case (needs {self.needs})")
        if not per_case and not self.runs_under:
            raise TypeError(f"property {self.id}: say where it runs (runs_under), as it has no case check")

    @property
    def per_case(self) -> bool:
        return self.check is not None

    @property
    def one_run(self) -> bool:
        """Judged from one run of the case's runners (and the metadata path): `harness check`'s default."""
        return self.per_case and self.needs & ~ONE_RUN == Needs(0)

    def unmet(self, run: CaseRun) -> Optional[str]:
        """Why this property can't judge this case run (skipped, never a pass); None: it can."""
        if Needs.BOTH_RUNNERS in self.needs and run.runner != "both":
            return f"compares eager with graph; this run has the {run.runner} runner only"
        if Needs.LOOP in self.needs:
            return spec_skip_reason(run.case)
        return None
