"""What the vLLM check reports: one VLine per (DP size, runner, bucket), the n/a list, the verdict."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from harness.engines.baseline import Classified
from harness.engines.report import LineVerdicts
from harness.props.p1_records import P1
from harness.verdict import Verdict


@dataclass
class VLine:
    """One (DP size, runner, bucket): the captures ("capture") or every replay that ran in the bucket, on every rank."""

    runner: str
    dp: int
    bucket: str  # "capture", "reqs=N tokens=M" (a FULL graph) or "eager"
    verdict: Verdict = field(default_factory=lambda: Verdict(P1))
    raw_bs: set[int] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)
    captured: list[int] = field(default_factory=list)  # a capture line: the graphs' request counts

    def identity(self) -> dict[str, Any]:
        """Where this line's findings sit, as a baseline names them (harness/engines/baseline.py)."""
        return {"runner": self.runner, "dp": self.dp}

    def to_json(self) -> dict:
        return {"runner": self.runner, "dp": self.dp, "bucket": self.bucket, "raw_bs": sorted(self.raw_bs), "ranks": sorted(self.ranks),
                "captured_requests": self.captured, "ok": self.verdict.ok, "checked": self.verdict.checked,
                "failures": [asdict(f) for f in self.verdict.failures],
                "notes": list(self.verdict.notes)}


@dataclass
class VllmReport(LineVerdicts):
    version: str
    location: str
    config: dict[str, Any]
    lines: list[VLine]
    not_applicable: list[str]
    stubbed: list[str]
    seconds: float = 0.0
    api: str = "mrv2"  # the capture API driven (api.py): mrv2 request-keyed, mrv2-tok token-keyed, mrv2-tkr that with the model runner's q
    flags: str = ""  # the capture-size flags as that API takes them
    skipped: list[str] = field(default_factory=list)  # runners left out by the selection, with why
    baseline: Optional[Classified] = None

    def to_json(self) -> dict:
        return {
            "engine": "vllm", "version": self.version, "api": self.api, "location": self.location, "ok": self.ok,
            "seconds": round(self.seconds, 2),
            "config": self.config, "stubbed_modules": self.stubbed, "not_applicable": self.not_applicable,
            "paths": "path: gpu (vLLM's adapter has no NPU path)", "skipped": list(self.skipped), "summary": self.summary(),
            "first_failure": None if self.ok else asdict(self.lead()),
            **({"baseline": self.baseline.to_json()} if self.baseline is not None else {}),
            "lines": self.lines_json(),
        }


def format_report(rep: VllmReport) -> str:
    try:
        where = str(Path(rep.location).resolve().relative_to(Path.cwd().resolve())) or "."
    except ValueError:
        where = rep.location
    c = rep.config
    out = [f"engine-check: vllm {rep.version} from {where}",
           f"  EAGLE proposer graphs (target verify DP sync, draft prefill, draft decode): K={c['num_speculative_tokens']} "
           f"max_num_seqs={c['max_num_seqs']} "
           f"{rep.flags} dp={list(c['dp_sizes'])} ({rep.api}); no model, no GPU",
           f"  stubbed imports: {', '.join(rep.stubbed)}",
           "  path: gpu (vLLM's adapter has no NPU path)"]
    sw = 5 if rep.baseline is not None else 4
    for ln in rep.lines:
        v = ln.verdict
        raw = sorted(ln.raw_bs)
        raws = f"{raw[0]}..{raw[-1]}" if raw else "-"
        if ln.captured:
            tail_info = f" graphs at {','.join(map(str, ln.captured))} requests"
        else:
            tail_info = ""
        head = f"{rep.status(ln):<{sw}} {ln.runner:<18} dp={ln.dp} {ln.bucket:<19} raw_bs {raws:<6} ranks {','.join(map(str, sorted(ln.ranks))):<8}"
        if v.ok:
            tail = f"{v.checked} checks" + (f"; {len(v.notes)} n/a note(s)" if v.notes else "") + tail_info
        else:
            more = f" (+{len(v.failures) - 1} more)" if len(v.failures) > 1 else ""
            tail = v.failures[0].message() + more
        out.append(f"{head} {tail}")
    notes = [n for ln in rep.lines for n in ln.verdict.notes]
    seen: set[str] = set()
    firsts = [n for n in notes if not (n.split(":")[1] in seen or seen.add(n.split(":")[1]))]
    out.append("not applicable to vLLM's design (never counted as a pass):")
    out += [f"  {n}" for n in rep.not_applicable]
    out += [f"  {n} (+{sum(m.split(':')[1] == n.split(':')[1] for m in notes) - 1} like it)" for n in firsts]
    out += [f"skipped (not checked, not passed): {why}" for why in rep.skipped]
    out += rep.verdict_text("(dp, runner, bucket)", "runner")
    return "\n".join(out)
