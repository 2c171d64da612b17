"""What the vllm-ascend check reports: one line per (world, bucket), the n/a list, the verdict; text or one JSON document."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from harness.engines.baseline import Classified
from harness.engines.report import LineVerdicts
from harness.engines.vllm_ascend.checks import ALine


@dataclass
class AscendReport(LineVerdicts):
    version: str
    vllm_version: str
    location: str
    config: dict[str, Any]
    lines: list[ALine]
    not_applicable: list[str]
    stubbed: list[str]
    compiled: dict[str, str]  # the model runner's functions compiled from the release's source, with where they are
    seconds: float = 0.0
    baseline: Optional[Classified] = None

    def to_json(self) -> dict:
        return {
            "engine": "vllm-ascend", "version": self.version, "vllm": self.vllm_version, "path": "v1 model runner, merged draft ACL graph",
            "location": self.location, "ok": self.ok, "seconds": round(self.seconds, 2), "config": self.config,
            "stubbed_modules": self.stubbed, "compiled_from_source": self.compiled, "not_applicable": self.not_applicable,
            "summary": self.summary(), "first_failure": None if self.ok else asdict(self.lead()),
            **({"baseline": self.baseline.to_json()} if self.baseline is not None else {}),
            "lines": [ln.to_json() for ln in self.lines],
        }


def format_report(rep: AscendReport) -> str:
    try:
        where = str(Path(rep.location).resolve().relative_to(Path.cwd().resolve())) or "."
    except ValueError:
        where = rep.location
    c = rep.config
    out = [f"engine-check: vllm-ascend {rep.version} (on vllm {rep.vllm_version}) from {where}",
           f"  merged EAGLE draft ACL graph (v1 model runner): K={c['num_speculative_tokens']} max_num_seqs={c['max_num_seqs']} "
           f"cudagraph_capture_sizes={list(c['cudagraph_capture_sizes'])}; no model, no NPU",
           f"  compiled from the release's model runner: {', '.join(f'{k} ({v})' for k, v in rep.compiled.items())}",
           f"  stubbed imports: {', '.join(rep.stubbed)}"]
    width = max((len(ln.world) for ln in rep.lines), default=0)
    for ln in rep.lines:
        v = ln.verdict
        raw = sorted(ln.raw)
        raws = f"{raw[0]}..{raw[-1]}" if raw else "-"
        head = f"{'ok  ' if v.ok else 'FAIL'} {ln.world:<{width}} {ln.bucket:<10} raw_bs {raws:<5} ranks {','.join(map(str, sorted(ln.ranks))):<4}"
        if v.ok:
            tail = f"{v.checked} checks" + (f" graphs at {','.join(map(str, ln.captured))} tokens" if ln.captured else "")
        else:
            more = f" (+{len(v.failures) - 1} more)" if len(v.failures) > 1 else ""
            tail = v.failures[0].message() + more
        out.append(f"{head} {tail}")
    out.append("not applicable to vllm-ascend's merged draft graph (never counted as a pass):")
    out += [f"  {n}" for n in rep.not_applicable]
    out += rep.verdict_text("(world, bucket)", "world")
    return "\n".join(out)
