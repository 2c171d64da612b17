"""What engine-check reports: one Line per (runner, layout, bucket), the EngineReport, and its text form."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.props.p1_records import P1
from harness.verdict import Failure, Verdict
from runners.parallel.layout import ParallelLayout


@dataclass
class Line:
    """One (runner, layout, bucket): every replay that landed in the bucket, on every rank checked."""

    runner: str
    step: int
    layout: ParallelLayout
    bucket: int
    tokens_per_bs: int = 0
    verdict: Verdict = field(default_factory=lambda: Verdict(P1))
    raw_bs: set[int] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)
    pruned: bool = False

    @property
    def label(self) -> str:
        return f"{self.runner}[{self.step}]" if self.runner.startswith("multi_layer") else self.runner

    def to_json(self) -> dict:
        return {
            "runner": self.runner, "step": self.step, "branch": self.layout.branch.value, "layout": self.layout.describe(),
            "bucket": self.bucket, "tokens_per_bs": self.tokens_per_bs, "raw_bs": sorted(self.raw_bs), "ranks": sorted(self.ranks),
            "pruned_logits": self.pruned, "ok": self.verdict.ok, "checked": self.verdict.checked,
            "failures": [asdict(f) for f in self.verdict.failures], "notes": list(self.verdict.notes),
        }


class LineVerdicts:
    """What a report of per-line verdicts says as a whole, the same for every engine's report
    (the release table, harness.engines.releases, reads one `summary` schema from all of them).
    The inheriting dataclass has a `lines` field whose items carry a `verdict`."""

    @property
    def ok(self) -> bool:
        return all(ln.verdict.ok for ln in self.lines)

    def failures(self) -> list[Failure]:
        return [f for ln in self.lines for f in ln.verdict.failures]

    def summary(self) -> dict[str, int]:
        return {"lines": len(self.lines), "failed_lines": sum(not ln.verdict.ok for ln in self.lines),
                "checks": sum(ln.verdict.checked for ln in self.lines), "failures": len(self.failures()),
                "notes": sum(len(ln.verdict.notes) for ln in self.lines)}

    def verdict_text(self, unit: str, group: str) -> list[str]:
        """The closing lines of a text report: the failing (check, field, group) triples, then the verdict.
        `unit` names what a line is (e.g. "(runner, branch, bucket)"); `group` is the `where` key the triples show."""
        checks = sum(ln.verdict.checked for ln in self.lines)
        if self.ok:
            return [f"verdict: PASS: {len(self.lines)} {unit} lines, {checks} checks ({self.seconds:.1f}s)"]
        failures = self.failures()
        triples = sorted({(f.check, f.field, f.where.get(group)) for f in failures}, key=lambda t: tuple(map(str, t)))
        failed = sum(not ln.verdict.ok for ln in self.lines)
        return [f"failing (check, field, {group}): " + "; ".join(f"{c} {fl} [{g}]" for c, fl, g in triples),
                f"verdict: FAIL: {failed} of {len(self.lines)} {unit} lines failed, {len(failures)} failures in "
                f"{checks} checks ({self.seconds:.1f}s); first: {failures[0].message()}"]


@dataclass
class EngineReport(LineVerdicts):
    engine: str
    version: str
    generation: str
    location: str
    lines: list[Line]
    stubbed: list[str]
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)  # invariants not checked on this engine, each with its reason

    def to_json(self) -> dict:
        return {
            "engine": self.engine, "version": self.version, "api": self.generation, "location": self.location, "ok": self.ok,
            "seconds": round(self.seconds, 2), "stubbed_modules": self.stubbed, "skipped": list(self.skipped),
            "summary": self.summary(),
            "lines": [ln.to_json() for ln in self.lines],
        }



def format_report(rep: EngineReport, cfg: Any) -> str:
    try:
        where = str(Path(rep.location).resolve().relative_to(Path.cwd().resolve())) or "."
    except ValueError:
        where = rep.location
    out = [f"engine-check: sglang {rep.version} ({rep.generation} API) from {where}",
           f"  EAGLE draft-extend graph runners: num_steps={cfg.num_steps} topk={cfg.topk} num_draft_tokens={cfg.num_draft_tokens} "
           f"capture_bs={list(cfg.capture_bs)} max_running_requests={cfg.max_running_requests}; no model, no GPU",
           f"  stubbed imports: {', '.join(rep.stubbed)}"]
    lw = max(len(_layout_name(ln.layout)) for ln in rep.lines)
    nw = max(15, *(len(ln.label) for ln in rep.lines))  # multi_layer_1g[k] is 17
    for ln in rep.lines:
        v = ln.verdict
        raw = sorted(ln.raw_bs)
        raws = f"{raw[0]}..{raw[-1]}" if raw else "-"
        head = (f"{'ok  ' if v.ok else 'FAIL'} {ln.label:<{nw}} {ln.layout.branch.value:<14} {_layout_name(ln.layout):<{lw}} bs={ln.bucket:<3} "
                f"T={ln.tokens_per_bs} raw_bs {raws:<6} ranks {','.join(map(str, sorted(ln.ranks))):<8}")
        if v.ok:
            tail = f"{v.checked} checks" + (" (pruned logits)" if ln.pruned else "") + (f"; {len(v.notes)} note(s)" if v.notes else "")
        else:
            more = f" (+{len(v.failures) - 1} more)" if len(v.failures) > 1 else ""
            tail = v.failures[0].message() + more
        out.append(f"{head} {tail}")
    groups: dict[tuple, list[str]] = {}
    for ln in rep.lines:
        for n in ln.verdict.notes:
            groups.setdefault((n.split(" ", 1)[0], ln.layout.branch.value), []).append(n)
    if groups:
        out.append(f"notes ({sum(map(len, groups.values()))}; the first of each check and branch, then the count):")
        for (_check, branch), ns in groups.items():
            out.append(f"  {ns[0]}" + (f" (+{len(ns) - 1} like it in {branch})" if len(ns) > 1 else ""))
    out += [f"skipped (not checked, not passed): {why}" for why in rep.skipped]
    out += rep.verdict_text("(runner, branch, bucket)", "branch")
    return "\n".join(out)


def _layout_name(layout: ParallelLayout) -> str:
    return layout.describe().split(" [")[0]
