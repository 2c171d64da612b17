"""The engine behind `harness replay <case>`: rerun one case, show every step, point at the first divergence."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


from harness.case import Case
from harness.checks import PROPERTY_ORDER, CaseReport, check_case


@dataclass
class StepRow:
    iteration: int
    step: int
    rank: int
    branch: str
    raw_bs: int
    bs: Optional[int]
    num_tokens: Optional[int]
    for_logprob: Optional[int]
    dp_buffer_len: Optional[int]
    rows_fed: Optional[int]
    max_logit_diff: Optional[float]


@dataclass
class ReplayReport:
    case: str
    layout: str
    report: CaseReport
    rows: list[StepRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.report.ok

    def first_divergence(self) -> Optional[dict]:
        for prop in PROPERTY_ORDER:
            v = self.report.verdicts.get(prop)
            if v is not None and not v.ok:
                f = v.failures[0]
                return {"property": prop, "check": f.check, "field": f.field, "where": f.where, "expected": f.expected, "got": f.got,
                        "detail": f.detail, "message": f.message()}
        return None

    def to_json(self) -> dict:
        return {"case": self.case, "layout": self.layout, "ok": self.ok, "steps": [r.__dict__ for r in self.rows],
                "first_divergence": self.first_divergence(), "properties": {k: v.to_json() for k, v in self.report.verdicts.items()}}


def replay_case(case: Case, step: Optional[int] = None, rank: Optional[int] = None, progress=None) -> ReplayReport:
    rep = check_case(case, on_progress=progress)
    out = ReplayReport(case.name, case.layout.describe(), rep)
    if rep.runs is None:
        return out
    layout, T = case.layout, case.scenario.spec.num_tokens_per_bs
    for run in rep.runs:
        if rank is not None and run.rank != rank:
            continue
        d = layout.attn_dp_rank(run.rank)
        for it, graph_steps in enumerate(run.graph):
            for s, g in enumerate(graph_steps):
                if step is not None and s != step:
                    continue
                rec = run.records[it][s] if run.records[it] else None
                e = run.eager[it][s] if it < len(run.eager) else None
                diff = None
                if e is not None and e.tensors["logits"].numel():
                    diff = float((e.tensors["logits"].double() - g.tensors["logits"].double()).abs().max())
                elif e is not None:
                    diff = 0.0
                lp = rec.global_num_tokens_for_logprob_gpu if rec else None
                host = rec.capture.host if rec else {}
                out.rows.append(StepRow(
                    it, s, run.rank, layout.branch.value, len(run.rids[it]), rec.bs if rec else None,
                    rec.bs * T if rec else None,
                    (host.get("global_num_tokens_for_logprob_cpu") or [None] * (d + 1))[d if layout.require_mlp_tp_gather else 0] if lp else None,
                    host.get("global_dp_buffer_len"), rec.rows_fed if rec else None, diff,
                ))
    return out


def format_table(rep: ReplayReport) -> str:
    head = f"{'iter':>4} {'step':>4} {'rank':>4} {'branch':<15} {'raw_bs->bs':>10} {'num_tok':>7} {'for_logprob':>11} {'dp_buf':>6} {'rows_fed':>8} {'max|dlogit|':>11}"
    lines = [f"case {rep.case}: {rep.layout}", head, "-" * len(head)]
    for r in rep.rows:
        bs = f"{r.raw_bs}->{r.bs}" if r.bs is not None else f"{r.raw_bs}->eager"
        diff = "-" if r.max_logit_diff is None else f"{r.max_logit_diff:.2e}"
        fmt = lambda x: "-" if x is None else str(x)  # noqa: E731
        lines.append(f"{r.iteration:>4} {r.step:>4} {r.rank:>4} {r.branch:<15} {bs:>10} {fmt(r.num_tokens):>7} {fmt(r.for_logprob):>11} "
                     f"{fmt(r.dp_buffer_len):>6} {fmt(r.rows_fed):>8} {diff:>11}")
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
    return "\n".join(lines)


