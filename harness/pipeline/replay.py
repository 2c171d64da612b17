"""The engine behind `harness replay <case>`: rerun one case through the case pipeline, show every step, point at the
first divergence.

`--runner eager|graph|both` picks what runs (both: eager vs graph is P3; one runner: each step is compared with the
TP1 eager oracle, P4). The verdicts are `harness check`'s, from the same pipeline (harness.pipeline.check.judge) and
the case's own tolerances; the table only adds what each step fed its runners. `--dump DIR` (harness.pipeline.dump)
writes every rank's buffers and metadata at the first divergence; progress goes to `progress` once per iteration.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from harness.cases.case import Case
from harness.pipeline.check import CaseReport, judge
from harness.props import registry
from harness.ranks import RanksKind
from harness.run.case_run import CaseRun
from harness.run.rig import RankRun, RunnerChoice


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
    diverges: bool = False  # a property failed at this iteration, step and rank


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

    def failures(self) -> list:
        """(property, failure) in report order."""
        return [(prop, f) for prop in registry.report_order() for v in [self.report.verdicts.get(prop)] if v is not None for f in v.failures]

    def first_divergence(self) -> Optional[dict]:
        """The first failure in property order; with --rank / --step, the first one at that rank / step if there is one."""
        failures = self.failures()
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
                "properties": {k: v.to_json() for k, v in self.report.verdicts.items()}, "skipped": dict(self.report.skipped)}


def _oracle_rows(oracle: list[RankRun], it: int, step: int, rids: list[int], T: int) -> torch.Tensor:
    ref = oracle[0]
    pos = {rid: i for i, rid in enumerate(ref.rids[it])}
    logits = ref.eager[it][step].out.logits
    return torch.cat([logits[pos[r] * T:(pos[r] + 1) * T] for r in rids]) if rids else logits[:0]


def check_filters(case: Case, step: Optional[int], rank: Optional[int]) -> None:
    """A --step or --rank the case does not run would filter every row out: an empty table that passes."""
    steps, world = case.scenario.spec.num_steps, case.layout.world_size
    if step is not None and not 0 <= step < steps:
        raise ValueError(f"--step {step}: {case.name} runs draft steps 0..{steps - 1} (num_steps = {steps})")
    if rank is not None and not 0 <= rank < world:
        raise ValueError(f"--rank {rank}: {case.name} runs ranks 0..{world - 1} (world size {world})")


def replay_case(case: Case, step: Optional[int] = None, rank: Optional[int] = None, progress: Optional[Callable[[str], None]] = None,
                ranks: RanksKind = RanksKind.SIM, runner: RunnerChoice = "both") -> ReplayReport:
    """The case through the pipeline with the chosen runner(s), judged by the properties of one run (as `harness check`
    judges it), and a row per (iteration, draft step, rank)."""
    check_filters(case, step, rank)
    run = CaseRun(case, ranks, runner, progress)
    rep = judge(run, registry.default_ids())
    out = ReplayReport(case.name, case.layout.describe(), rep, runner=runner, rank_filter=rank, step_filter=step)
    if rep.runs is None:
        return out
    failing = {(f.where.get("iteration"), f.where.get("step"), f.where.get("rank")) for _, f in out.failures()}
    layout, T = case.layout, case.scenario.spec.num_tokens_per_bs
    own = (lambda d: d) if layout.require_mlp_tp_gather else (lambda d: 0)
    for rr in rep.runs:
        if rank is not None and rr.rank != rank:
            continue
        d = layout.attn_dp_rank(rr.rank)
        for it in range(len(rr.rids)):
            steps = rr.graph[it] if rr.graph else rr.eager[it]
            for s, res in enumerate(steps):
                if step is not None and s != step:
                    continue
                rec = rr.records[it][s] if rr.graph and rr.records[it] else None
                e = rr.eager[it][s] if rr.eager else None
                if runner == "both":
                    ref = e.out.logits
                elif rep.oracle is not None:
                    ref = _oracle_rows(rep.oracle, it, s, rr.rids[it], T)
                else:
                    ref = None
                got = res.out.logits
                diff = None
                if ref is not None and ref.shape == got.shape:
                    diff = float((ref.double() - got.double()).abs().max()) if got.numel() else 0.0
                if rec is not None:
                    host = rec.capture.host
                    bs, num_tok, rows_fed = rec.bs, rec.bs * T, rec.rows_fed
                else:  # eager: the live batch's metadata
                    host = e.host if e is not None else {}
                    bs, num_tok, rows_fed = None, host.get("num_tokens"), int(res.out.rows_fed)
                lp_list = host.get("global_num_tokens_for_logprob_cpu")
                lp = lp_list[own(d)] if lp_list else None
                branch = rec.branch if rec is not None else layout.branch.value  # the runner's (a draft may have a layout of its own)
                out.rows.append(StepRow(it, s, rr.rank, branch, len(rr.rids[it]), bs, num_tok, lp,
                                        host.get("global_dp_buffer_len"), rows_fed, diff, (it, s, rr.rank) in failing))
    return out


def _cells(r: StepRow) -> tuple[str, ...]:
    """A row as the table shows it, but its rank."""
    fmt = lambda x: "-" if x is None else str(x)  # noqa: E731
    bs = f"{r.raw_bs}->{r.bs}" if r.bs is not None else f"{r.raw_bs}->eager"
    diff = "-" if r.max_logit_diff is None else f"{r.max_logit_diff:.2e}"
    return (f"{r.branch:<15}", f"{bs:>10}", f"{fmt(r.num_tokens):>10}", f"{fmt(r.global_num_tokens_for_logprob):>29}",
            f"{fmt(r.global_dp_buffer_len):>20}", f"{fmt(r.rows_fed):>8}", f"{diff:>11}" + ("  << diverges" if r.diverges else ""))


def fold_ranks(rows: list[StepRow]) -> list[tuple[int, int, str, tuple[str, ...]]]:
    """(iteration, step, ranks, cells) in (iteration, step, rank) order, consecutive ranks that show the same folded
    into one row ("0-3")."""
    out: list[tuple[int, int, list[int], tuple[str, ...]]] = []
    for r in sorted(rows, key=lambda r: (r.iteration, r.step, r.rank)):
        cells = _cells(r)
        if out and out[-1][:2] == (r.iteration, r.step) and out[-1][3] == cells and out[-1][2][-1] + 1 == r.rank:
            out[-1][2].append(r.rank)
        else:
            out.append((r.iteration, r.step, [r.rank], cells))
    return [(it, s, str(rk[0]) if len(rk) == 1 else f"{rk[0]}-{rk[-1]}", cells) for it, s, rk, cells in out]


def format_table(rep: ReplayReport) -> str:
    head = (f"{'iter':>4} {'step':>4} {'rank':>5} {'branch':<15} {'raw_bs->bs':>10} {'num_tokens':>10} {'global_num_tokens_for_logprob':>29} "
            f"{'global_dp_buffer_len':>20} {'rows_fed':>8} {'max|dlogit|':>11}")
    lines = [f"case {rep.case}: {rep.layout}", head, "-" * len(head)]
    for it, s, ranks, cells in fold_ranks(rep.rows):
        lines.append(f"{it:>4} {s:>4} {ranks:>5} " + " ".join(cells))
    marked = sum(r.diverges for r in rep.rows)
    lines.append(f"(max|dlogit|: {rep.diff_label}, real rows; ranks that show the same share a row"
                 + (f"; << marks the {marked} rank-step(s) where a property failed)" if marked else ")"))
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
