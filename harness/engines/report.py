"""What engine-check reports: one Line per (runner, layout, bucket, path), the EngineReport, and its text form.

LineVerdicts is what every engine's report shares: the verdict, the summary, and the findings
against a baseline (baseline.py): each failure known or new, and the exit status that follows.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from harness.engines.baseline import Baseline, Classified, Finding
from harness.engines.guard import CRASHED, OUT_OF_BOUNDS, RAISED
from harness.engines.lanes import STALE_SLOT
from harness.engines.options import Selection
from harness.props.p1_records import P1
from harness.verdict import Failure, Verdict
from runners.parallel.layout import ParallelLayout


@dataclass
class Line:
    """One (runner, layout, bucket, path): every replay that landed in the bucket, on every rank checked. bucket None: the
    runner as a whole (where a call that is in no bucket -- building it, a replay that never reached a bucket -- raised);
    path: the device path whose code filled the buffers (options.FillPath), "" where both devices run the same code."""

    runner: str
    step: int
    layout: ParallelLayout
    bucket: Optional[int]
    path: str = ""
    tokens_per_bs: int = 0
    verdict: Verdict = field(default_factory=lambda: Verdict(P1))
    raw_bs: set[int] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)
    pruned: bool = False

    @property
    def label(self) -> str:
        name = f"{self.runner}[{self.step}]" if self.runner.startswith("multi_layer") or self.step else self.runner
        return f"{name}:{self.path}" if self.path else name

    def identity(self) -> dict[str, Any]:
        """Where this line's findings sit, as a baseline names them (baseline.py)."""
        return {"runner": self.runner, "step": self.step, "branch": self.layout.branch.value, **({"path": self.path} if self.path else {})}

    def to_json(self) -> dict:
        return {
            "runner": self.runner, "step": self.step, "branch": self.layout.branch.value, "layout": self.layout.describe(),
            "path": self.path, "bucket": self.bucket, "tokens_per_bs": self.tokens_per_bs, "raw_bs": sorted(self.raw_bs), "ranks": sorted(self.ranks),
            "pruned_logits": self.pruned, "ok": self.verdict.ok, "checked": self.verdict.checked,
            "failures": [asdict(f) for f in self.verdict.failures], "notes": list(self.verdict.notes),
        }


class LineVerdicts:
    """What a report of per-line verdicts says as a whole, the same for every engine's report
    (the release table, harness.engines.releases, reads one `summary` schema from all of them).
    The inheriting dataclass has a `lines` field whose items carry a `verdict` and an `identity()`, and a
    `baseline` field (None: no baseline given)."""

    # failure `where` keys that name a finding beside its line's identity (baseline.py)
    FINDING_KEYS: tuple[str, ...] = ()
    # the checks a report leads with, most severe first (guard.py's: the engine killed the process, wrote or read out of bounds,
    # raised)
    LEAD_CHECKS: tuple[str, ...] = (CRASHED, OUT_OF_BOUNDS, RAISED)

    def lead_rank(self, f: Failure) -> int:
        return self.LEAD_CHECKS.index(f.check) if f.check in self.LEAD_CHECKS else len(self.LEAD_CHECKS)

    def order_failures(self) -> None:
        """Each line's failures, its most severe first (stable otherwise): the line's text shows the first."""
        for ln in self.lines:
            ln.verdict.failures.sort(key=self.lead_rank)

    @property
    def ok(self) -> bool:
        return all(ln.verdict.ok for ln in self.lines)

    def failures(self) -> list[Failure]:
        return [f for ln in self.lines for f in ln.verdict.failures]

    def finding(self, ln: Any, f: Failure) -> Finding:
        return Finding.of(ln.identity(), f, self.FINDING_KEYS)

    def classify(self, base: Baseline, file: str) -> Classified:
        found = sorted({self.finding(ln, f) for ln in self.lines for f in ln.verdict.failures})
        self.baseline = base.classify(found, [ln.identity() for ln in self.lines], file)
        return self.baseline

    def as_baseline(self, engine: str, written_from: str) -> Baseline:
        return Baseline(engine, {self.finding(ln, f): "" for ln in self.lines for f in ln.verdict.failures}, written_from)

    def exit_code(self) -> int:
        """0: every check held, or (with a baseline) every finding is known; 1: a finding (a new one, with a baseline)."""
        if self.baseline is not None:
            return 1 if self.baseline.new else 0
        return 0 if self.ok else 1

    def status(self, ln: Any) -> str:
        """A line's verdict: ok, FAIL, or (with a baseline) known: every failure of it is in the baseline."""
        if ln.verdict.ok:
            return "ok"
        if self.baseline is not None and all(self.baseline.known.get(self.finding(ln, f)) for f in ln.verdict.failures):
            return "known"
        return "FAIL"

    def lead(self) -> Failure:
        """The failure a report leads with: the most severe (LEAD_CHECKS), the first of them; where a baseline is given,
        among the new ones."""
        failures = self.failures()
        if self.baseline is not None:
            new = [f for ln in self.lines for f in ln.verdict.failures if not self.baseline.known.get(self.finding(ln, f))]
            failures = new or failures
        return min(failures, key=self.lead_rank)

    def lines_json(self) -> list[dict]:
        """Each line's JSON, every failure marked "new" or "known" where a baseline is given."""
        out = []
        for ln in self.lines:
            doc = ln.to_json()
            if self.baseline is not None:
                for f, fj in zip(ln.verdict.failures, doc["failures"], strict=True):
                    fj["baseline"] = "known" if self.baseline.known.get(self.finding(ln, f)) else "new"
            out.append(doc)
        return out

    def summary(self) -> dict[str, int]:
        return {"lines": len(self.lines), "failed_lines": sum(not ln.verdict.ok for ln in self.lines),
                "checks": sum(ln.verdict.checked for ln in self.lines), "failures": len(self.failures()),
                "notes": sum(len(ln.verdict.notes) for ln in self.lines)}

    def verdict_text(self, unit: str, group: str) -> list[str]:
        """The closing lines of a text report: the failing (check, field, group) triples, the baseline, then the verdict.
        `unit` names what a line is (e.g. "(runner, branch, bucket)"); `group` is the `where` key the triples show."""
        checks = sum(ln.verdict.checked for ln in self.lines)
        if self.ok:
            return [f"verdict: PASS: {len(self.lines)} {unit} lines, {checks} checks ({self.seconds:.1f}s)"]
        failures = self.failures()
        triples = sorted({(f.check, f.field, f.where.get(group)) for f in failures}, key=lambda t: tuple(map(str, t)))
        failed = sum(not ln.verdict.ok for ln in self.lines)
        out = [f"failing (check, field, {group}): " + "; ".join(f"{c} {fl} [{g}]" for c, fl, g in triples)]
        counts = f"{failed} of {len(self.lines)} {unit} lines failed, {len(failures)} failures in {checks} checks ({self.seconds:.1f}s)"
        if self.baseline is not None:
            out += self.baseline.text()
            if not self.baseline.new:
                return out + [f"verdict: PASS (known findings only, baseline {self.baseline.file}): {counts}; first: {self.lead().message()}"]
            return out + [f"verdict: FAIL: {len(self.baseline.new)} new finding identities; {counts}; first new: {self.lead().message()}"]
        return out + [f"verdict: FAIL: {counts}; first: {self.lead().message()}"]


@dataclass
class EngineReport(LineVerdicts):
    """What `check_engine` found on one engine release: a verdict per (runner, layout, bucket) line, the modules it
    stubbed to import the engine, and what it did not check with the reason (`skipped`), so that a pass never
    hides an unchecked runner.
    """
    FINDING_KEYS = ("page_size",)
    LEAD_CHECKS = (CRASHED, OUT_OF_BOUNDS, RAISED, STALE_SLOT)  # then a padded token's KV write into a request's slot (lanes.py)

    engine: str
    version: str
    generation: str
    location: str
    lines: list[Line]
    stubbed: list[str]
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)  # invariants not checked on this engine, each with its reason
    paths: str = ""  # the device paths checked and left out, with why (sglang/paths.py)
    selection: Selection = field(default_factory=Selection)
    baseline: Optional[Classified] = None

    def to_json(self) -> dict:
        return {
            "engine": self.engine, "version": self.version, "api": self.generation, "location": self.location, "ok": self.ok,
            "seconds": round(self.seconds, 2), "stubbed_modules": self.stubbed, "paths": self.paths,
            "selected": {"paths": sorted(p.value for p in self.selection.paths),
                         "runners": None if self.selection.runners is None else sorted(self.selection.runners)},
            "skipped": list(self.skipped), "summary": self.summary(), "first_failure": None if self.ok else asdict(self.lead()),
            **({"baseline": self.baseline.to_json()} if self.baseline is not None else {}),
            "lines": self.lines_json(),
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
    out += [f"  {rep.paths}"] if rep.paths else []
    out += [f"  runners: {', '.join(sorted(rep.selection.runners))} only"] if rep.selection.runners is not None else []
    lw = max([len(_layout_name(ln.layout)) for ln in rep.lines], default=0)
    nw = max([15, *(len(ln.label) for ln in rep.lines)])  # multi_layer_1g[k]:gpu is 21
    sw = 5 if rep.baseline is not None else 4
    for ln in rep.lines:
        v = ln.verdict
        raw = sorted(ln.raw_bs)
        raws = f"{raw[0]}..{raw[-1]}" if raw else "-"
        bucket = "-" if ln.bucket is None else ln.bucket
        head = (f"{rep.status(ln):<{sw}} {ln.label:<{nw}} {ln.layout.branch.value:<14} {_layout_name(ln.layout):<{lw}} bs={bucket:<3} "
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
