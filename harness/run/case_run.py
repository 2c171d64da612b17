"""The runs of one case, built once and handed to every property that needs them.

`harness check`, `harness replay`, the pytest plugin and the API judge a case through one `CaseRun`: the case run
(eager and/or graph on the case's layout and ranks) and the TP1 oracle are built on first use and shared, so two
properties never run the same runners twice and always judge them by the case's own `[tolerances]`. What the runs
themselves find (a rank that failed: "run"; checks instruments made while a loop ran) collects in `found`, reported
once however many properties read the run.
"""
from __future__ import annotations

import threading
import time
from functools import partial
from typing import Callable, Optional, TypeVar

from harness.cases.case import Case
from harness.errors import OutOfMemory, is_oom
from harness.ranks import RanksKind
from harness.ranks import run as ranks_run
from harness.ranks.simulated import RankFailure
from harness.ranks.trace import CollectiveError
from harness.run.crash import crash_detail, crash_name, crash_verdict
from harness.run.rig import RankRun, RunnerChoice, run_rank
from harness.run.scenario import Scenario
from harness.verdict import Verdict, merge_verdicts

T = TypeVar("T")
RUN = "run"  # the verdict of the runs themselves: every rank finished, the collectives agreed


class RunCrashed(Exception):
    """A rank of the case run failed: `found["run"]` says how, and nothing on that run can be judged."""


def run_spmd(sc: Scenario, runner: RunnerChoice = "both", single_layer: bool = False, timeout_s: float = 60.0,
             ranks: RanksKind | str = RanksKind.SIM, on_step: Optional[Callable[[int, int], None]] = None) -> list[RankRun]:
    """Every rank's run of the scenario (run_rank) on the chosen ranks. `on_step(rank, iteration)` (simulated ranks
    only: real ones are other processes) follows each rank's iterations."""
    kind = RanksKind.parse(ranks)
    fn = partial(run_rank, on_step=on_step) if on_step is not None and kind is RanksKind.SIM else run_rank
    return ranks_run(sc.layout, fn, sc, runner, single_layer, "auto", kind.device, ranks=kind, timeout_s=timeout_s)[0]


class CaseRun:
    def __init__(self, case: Case, ranks: RanksKind | str = RanksKind.SIM, runner: RunnerChoice = "both",
                 on_progress: Optional[Callable[[str], None]] = None):
        self.case, self.sc = case, case.scenario
        self.ranks, self.runner = RanksKind.parse(ranks), runner
        self.found: dict[str, Verdict] = {}
        self._say = on_progress or (lambda _msg: None)
        self._runs: Optional[list[RankRun]] = None
        self._crashed = False
        self._oracle: Optional[list[RankRun]] = None
        self._shared: dict[str, object] = {}

    @property
    def layout_text(self) -> str:
        return self.sc.layout.describe()

    @property
    def runner_kinds(self) -> tuple[str, ...]:
        """The runners the case run has: ("eager", "graph") side by side, or the one chosen."""
        return ("eager", "graph") if self.runner == "both" else (self.runner,)

    def say(self, msg: str) -> None:
        self._say(msg)

    def record(self, verdicts: dict[str, Verdict]) -> None:
        """Verdicts the runs themselves produced (a crash, an instrument's checks), reported once with the case."""
        merge_verdicts(self.found, verdicts)

    # ---- the case run and its oracle ----
    @property
    def runs(self) -> list[RankRun]:
        """Every rank's run of the case (built on first use). Raises RunCrashed when a rank failed (then found["run"]),
        OutOfMemory when the machine ran short (no property is judged: that is not the case's fault)."""
        if self._crashed:
            raise RunCrashed(self.case.name)
        if self._runs is None:
            what = "eager + graph" if self.runner == "both" else self.runner
            self.say(f"{what} on {self.ranks} ranks ({self.sc.layout.world_size}), {len(self.sc.iterations)} iteration(s): {self.layout_text}")
            try:
                self._runs = run_spmd(self.sc, runner=self.runner, ranks=self.ranks, on_step=self._iteration_ticks())
            except (RankFailure, CollectiveError) as err:  # simulated or real ranks
                if is_oom(getattr(err, "root_exception", err), crash_name(err)):
                    raise OutOfMemory(f"{self.case.name}: a rank ran out of memory ({crash_detail(err)})") from err
                self._crashed = True
                self.record({RUN: crash_verdict(RUN, {"layout": self.layout_text}, err)})
                raise RunCrashed(self.case.name) from err
        return self._runs

    def runs_or_none(self) -> Optional[list[RankRun]]:
        """The case run, or None when it crashed (found["run"] says how)."""
        try:
            return self.runs
        except RunCrashed:
            return None

    @property
    def built_runs(self) -> Optional[list[RankRun]]:
        """The case run if some property needed it (never builds it)."""
        return self._runs

    @property
    def oracle(self) -> list[RankRun]:
        """TP1 eager over every DP group's requests: P4's reference. Always in this process, on simulated ranks."""
        if self._oracle is None:
            self.say("TP1 oracle: eager, every DP group's requests in one batch")
            self._oracle = run_spmd(self.sc.as_tp1(), runner="eager")
        return self._oracle

    @property
    def built_oracle(self) -> Optional[list[RankRun]]:
        return self._oracle

    def shared(self, key: str, build: Callable[[], T]) -> T:
        """A run several properties read (the loop's sessions), built by the first that asks."""
        if key not in self._shared:
            self._shared[key] = build()
        return self._shared[key]  # type: ignore[return-value]

    def _iteration_ticks(self) -> Optional[Callable[[int, int], None]]:
        """Progress once every rank has finished an iteration (simulated ranks: threads of this process)."""
        if self.ranks is not RanksKind.SIM:
            return None
        n_it, world = len(self.sc.iterations), self.sc.layout.world_size
        done: dict[int, int] = {}
        lock, t0 = threading.Lock(), time.perf_counter()

        def tick(_rank: int, it: int) -> None:
            with lock:
                done[it] = done.get(it, 0) + 1
                if done[it] == world:
                    self.say(f"iteration {it + 1}/{n_it} done on {world} rank(s) ({time.perf_counter() - t0:.1f}s)")

        return tick
