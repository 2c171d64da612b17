"""The engine behind `harness replay <case>`: rerun one case, show every step, point at the first divergence.

`--runner eager|graph|both` picks what runs (both: eager vs graph is P3; one runner: each step is
compared with the TP1 eager oracle, P4); `--dump DIR` (harness/dump.py) writes every rank's
buffers and metadata at the first divergence; progress goes to `progress` once per iteration.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional

import torch

from harness.case import Case
from harness.checks import REPORT_ORDER, CaseReport, run_spmd
from harness.crash import crash_verdict
from harness.execute import RankRun, RunnerChoice, run_rank
from harness.props.p1_metadata import check_metadata
from harness.props.p1_run import check_run_metadata
from harness.props.p3 import check_eager_vs_graph
from harness.props.p4 import check_cross_layout
from harness.ranks import RanksKind
from harness.ranks import run as ranks_run
from harness.ranks.simulated import RankFailure
from harness.ranks.trace import CollectiveError


@dataclass
class StepRow:
    iteration: int
    step: int
    rank: int
    branch: str
    raw_bs: int
    bs: Optional[int]
    num_tokens: Optional[int]
    global_num_tokens_for_logprob: Optional[int]  # this rank's entry of the host list
    global_dp_buffer_len: Optional[int]
    rows_fed: Optional[int]
    max_logit_diff: Optional[float]


@dataclass
class ReplayReport:
    case: str
    layout: str
    report: CaseReport
    rows: list[StepRow] = field(default_factory=list)
    runner: str = "both"
    dump: Optional[str] = None  # the --dump directory, once written
    rank_filter: Optional[int] = None  # --rank / --step: the table's rows and the preferred first divergence
    step_filter: Optional[int] = None

    @property
    def diff_label(self) -> str:
        return "eager vs graph" if self.runner == "both" else f"{self.runner} vs the TP1 eager oracle"

    @property
    def ok(self) -> bool:
        return self.report.ok

    def first_divergence(self) -> Optional[dict]:
        """The first failure in property order; with --rank / --step, the first one at that rank / step if there is one."""
        failures = [(prop, f) for prop in REPORT_ORDER for v in [self.report.verdicts.get(prop)] if v is not None for f in v.failures]
        if not failures:
            return None

        def matches(f) -> bool:
            return all(want is None or f.where.get(key, want) == want for key, want in (("rank", self.rank_filter), ("step", self.step_filter)))

        prop, f = next(((p, f) for p, f in failures if matches(f)), failures[0])
        return {"property": prop, "check": f.check, "field": f.field, "where": f.where, "expected": f.expected, "got": f.got,
                "detail": f.detail, "message": f.message()}

    def to_json(self) -> dict:
        return {"case": self.case, "layout": self.layout, "ok": self.ok, "runner": self.runner, "max_logit_diff": self.diff_label,
                "steps": [r.__dict__ for r in self.rows], "first_divergence": self.first_divergence(), "dump": self.dump,
                "properties": {k: v.to_json() for k, v in self.report.verdicts.items()}}


def _run_with_progress(case: Case, runner: RunnerChoice, ranks: RanksKind, say: Callable[[str], None]) -> list[RankRun]:
    """run_spmd, reporting each iteration once every rank has finished it (simulated ranks)."""
    sc = case.scenario
    if ranks != "sim":
        return run_spmd(sc, runner=runner, ranks=ranks)
    n_it, world = len(sc.iterations), sc.layout.world_size
    done: dict[int, int] = {}
    lock, t0 = threading.Lock(), time.perf_counter()

    def tick(_rank: int, it: int) -> None:
        with lock:
            done[it] = done.get(it, 0) + 1
            if done[it] == world:
                say(f"iteration {it + 1}/{n_it} done on {world} rank(s) ({time.perf_counter() - t0:.1f}s)")

    return ranks_run(sc.layout, partial(run_rank, on_step=tick), sc, runner)[0]


def run_case(case: Case, runner: RunnerChoice = "both", ranks: RanksKind = RanksKind.SIM, progress: Optional[Callable[[str], None]] = None) -> CaseReport:
    """check_case with a choice of runner: P1 always; P3 (eager vs graph) with both; P4 for each runner that ran."""
    t0 = time.perf_counter()
    sc = case.scenario
    say = progress or (lambda _msg: None)
    rep = CaseReport(case.name, sc.layout.describe(), sc.layout.branch.value)
    say("P1 metadata")
    rep.verdicts["P1"] = check_metadata(sc.layout, sc.spec, case.schedule, sc.model, sc.seed)
    say(f"{'eager + graph' if runner == 'both' else runner} on {ranks} ranks ({sc.layout.world_size}), {len(sc.iterations)} iteration(s)")
    try:
        rep.runs = _run_with_progress(case, runner, ranks, say)
    except (RankFailure, CollectiveError) as err:
        rep.verdicts["run"] = crash_verdict("run", {"layout": sc.layout.describe()}, err)
        rep.seconds = time.perf_counter() - t0
        return rep
    rep.verdicts["P1"].merge(check_run_metadata(sc, rep.runs))
    if runner == "both":
        rep.verdicts["P3"] = check_eager_vs_graph(sc, rep.runs)
    say("TP1 oracle")
    rep.oracle = run_spmd(sc.as_tp1(), runner="eager")
    kinds = ("eager", "graph") if runner == "both" else (runner,)
    v = check_cross_layout(sc, rep.runs, rep.oracle, kinds[0])
    for kind in kinds[1:]:
        v.merge(check_cross_layout(sc, rep.runs, rep.oracle, kind))
    rep.verdicts["P4"] = v
    rep.seconds = time.perf_counter() - t0
    return rep


def _oracle_rows(oracle: list[RankRun], it: int, step: int, rids: list[int], T: int):
    ref = oracle[0]
    pos = {rid: i for i, rid in enumerate(ref.rids[it])}
    logits = ref.eager[it][step].tensors["logits"]
    return torch.cat([logits[pos[r] * T:(pos[r] + 1) * T] for r in rids]) if rids else logits[:0]


def check_filters(case: Case, step: Optional[int], rank: Optional[int]) -> None:
    """A --step or --rank the case does not run would filter every row out: an empty table that passes."""
    steps, world = case.scenario.spec.num_steps, case.layout.world_size
    if step is not None and not 0 <= step < steps:
        raise ValueError(f"--step {step}: {case.name} runs draft steps 0..{steps - 1} (num_steps = {steps})")
    if rank is not None and not 0 <= rank < world:
        raise ValueError(f"--rank {rank}: {case.name} runs ranks 0..{world - 1} (world size {world})")


def replay_case(case: Case, step: Optional[int] = None, rank: Optional[int] = None, progress=None, ranks: RanksKind = RanksKind.SIM,
                runner: str = "both") -> ReplayReport:
    check_filters(case, step, rank)
    rep = run_case(case, runner=runner, ranks=ranks, progress=progress)
    out = ReplayReport(case.name, case.layout.describe(), rep, runner=runner, rank_filter=rank, step_filter=step)
    if rep.runs is None:
        return out
    layout, T = case.layout, case.scenario.spec.num_tokens_per_bs
    own = (lambda d: d) if layout.require_mlp_tp_gather else (lambda d: 0)
    for run in rep.runs:
        if rank is not None and run.rank != rank:
            continue
        d = layout.attn_dp_rank(run.rank)
        for it in range(len(run.rids)):
            steps = run.graph[it] if run.graph else run.eager[it]
            for s, res in enumerate(steps):
                if step is not None and s != step:
                    continue
                rec = run.records[it][s] if run.graph and run.records[it] else None
                e = run.eager[it][s] if run.eager else None
                if runner == "both":
                    ref = e.tensors["logits"]
                elif rep.oracle is not None:
                    ref = _oracle_rows(rep.oracle, it, s, run.rids[it], T)
                else:
                    ref = None
                got = res.tensors["logits"]
                diff = None
                if ref is not None and ref.shape == got.shape:
                    diff = float((ref.double() - got.double()).abs().max()) if got.numel() else 0.0
                if rec is not None:
                    host = rec.capture.host
                    lp_list = host.get("global_num_tokens_for_logprob_cpu")
                    bs, num_tok, rows_fed = rec.bs, rec.bs * T, rec.rows_fed
                else:  # eager: the live batch's metadata
                    host = e.host if e is not None else {}
                    lp_list = host.get("global_num_tokens_for_logprob_cpu")
                    bs, num_tok, rows_fed = None, host.get("num_tokens"), int(res.tensors["rows_fed"])
                lp = lp_list[own(d)] if lp_list else None
                branch = rec.branch if rec is not None else layout.branch.value  # the runner's (a draft may have a layout of its own)
                out.rows.append(StepRow(it, s, run.rank, branch, len(run.rids[it]), bs, num_tok, lp,
                                        host.get("global_dp_buffer_len"), rows_fed, diff))
    return out


def format_table(rep: ReplayReport) -> str:
    head = (f"{'iter':>4} {'step':>4} {'rank':>4} {'branch':<15} {'raw_bs->bs':>10} {'num_tokens':>10} {'global_num_tokens_for_logprob':>29} "
            f"{'global_dp_buffer_len':>20} {'rows_fed':>8} {'max|dlogit|':>11}")
    lines = [f"case {rep.case}: {rep.layout}", head, "-" * len(head)]
    for r in rep.rows:
        bs = f"{r.raw_bs}->{r.bs}" if r.bs is not None else f"{r.raw_bs}->eager"
        diff = "-" if r.max_logit_diff is None else f"{r.max_logit_diff:.2e}"
        fmt = lambda x: "-" if x is None else str(x)  # noqa: E731
        lines.append(f"{r.iteration:>4} {r.step:>4} {r.rank:>4} {r.branch:<15} {bs:>10} {fmt(r.num_tokens):>10} "
                     f"{fmt(r.global_num_tokens_for_logprob):>29} {fmt(r.global_dp_buffer_len):>20} {fmt(r.rows_fed):>8} {diff:>11}")
    lines.append(f"(max|dlogit|: {rep.diff_label}, real rows)")
    lines.append("")
    for prop, v in rep.report.verdicts.items():
        lines.append(f"{prop}: {'ok' if v.ok else 'FAIL'} ({v.checked} checks, {len(v.failures)} failures)")
    div = rep.first_divergence()
    if div:
        w = div["where"]
        lines.append("")
        lines.append("first divergence:")
        lines.append(f"  {div['property']}/{div['check']}  field {div['field']}")
        lines.append("  at " + ", ".join(f"{k}={v}" for k, v in w.items()))
        lines.append(f"  expected {div['expected']}")
        lines.append(f"  got      {div['got']}")
        if div["detail"]:
            lines.append(f"  ({div['detail']})")
    if rep.dump:
        lines.append("")
        lines.append(f"dumped every rank's buffers and metadata to {rep.dump} (np.load(...); see {rep.dump}/divergence.json)")
    return "\n".join(lines)


