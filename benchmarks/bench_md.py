"""Markdown tables from `harness bench --json` files, for docs/gpu.md and the README (no hand copying).

  python benchmarks/bench_md.py benchmarks/results/h200_2026-12-05_bench_fp32.json [more.json ...]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HEADER = ("| backend | model | bs | eager step ms | graph step ms | step speedup | eager iter ms | graph iter ms | iter speedup "
          "| graph iter + records ms |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def table(res: dict) -> str:
    m = res["meta"]
    lines = [f"#### {m['dtype']} ({m['date']}, {m['device']})", "", HEADER]
    captures = []
    for b in res["backends"]:
        for r in b["rows"]:
            step = f"{r['graph_step_ms']:.3f}"
            if r.get("graph_replay_only_ms") is not None:
                step += f" ({r['graph_replay_only_ms']:.3f} replay only)"
            lines.append(f"| {b['backend']} | {b['model']} | {r['bs']} | {r['eager_step_ms']:.3f} | {step} | {r['step_speedup']:.1f}x "
                         f"| {r['eager_iter_ms']:.3f} | {r['graph_iter_ms']:.3f} | {r['iter_speedup']:.1f}x | {r['graph_iter_recorded_ms']:.3f} |")
        c = b["capture"]
        captures.append(f"{b['backend']} {c['seconds_total']:.2f} s")
    worst = max(r["max_abs_diff_logits"] for b in res["backends"] for r in b["rows"])
    lines += ["", f"Capture of all {res['backends'][0]['capture']['graphs']} graphs, warm-ups included: {'; '.join(captures)}. "
              f"max |graph - eager| on the logits: {worst:.1e}."]
    return "\n".join(lines)


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n\n".join(table(json.loads(Path(p).read_text())) for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
