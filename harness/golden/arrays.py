"""What goes into a golden: a case's runs flattened into named arrays (metadata packed, floats per key)."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from harness.cases.case import GOLDEN_FLOAT_FIELDS, Case
from harness.golden.base import INT_FIELDS, META_FIELDS
from harness.ranks import RanksKind
from harness.ranks import run as ranks_run
from harness.run.records import ReplayRecord
from harness.run.rig import RankRun, run_rank

# ----------------------------------------------------------------------------------------
# what goes in
# ----------------------------------------------------------------------------------------


def _record_meta(rec: Optional[ReplayRecord], rows_fed: int) -> dict[str, object]:
    if rec is None:  # an eager fallback: no graph replayed
        return {"graph_replayed": 0, "rows_fed": rows_fed}
    host = rec.capture.host
    return {
        "graph_replayed": 1,
        "raw_bs": rec.raw_bs,
        "bs": rec.bs,
        "num_tokens": host["num_tokens"],
        "global_num_tokens_cpu": host["global_num_tokens_cpu"],
        "global_num_tokens_for_logprob_cpu": host["global_num_tokens_for_logprob_cpu"],
        "global_dp_buffer_len": host["global_dp_buffer_len"],
        "capture.global_num_tokens_gpu": rec.capture.global_num_tokens_gpu,
        "capture.global_num_tokens_for_logprob_gpu": rec.capture.global_num_tokens_for_logprob_gpu,
        "global_num_tokens_gpu": rec.global_num_tokens_gpu,
        "global_num_tokens_for_logprob_gpu": rec.global_num_tokens_for_logprob_gpu,
        "padded_seq_lens": rec.padded_seq_lens,
        "seq_lens_sum": rec.seq_lens_sum,
        "rows_fed": rec.rows_fed,
        "logits_rows": rec.logits_rows,
    }


def pack_meta(meta: dict[str, object]) -> np.ndarray:
    out: list[int] = []
    for name in META_FIELDS:
        v = meta.get(name)
        vals = None if v is None else [int(x) for x in (v if isinstance(v, (list, tuple)) else [v])]
        out += [-1] if vals is None else [len(vals), *vals]
    return np.asarray(out, dtype=np.int64)


def unpack_meta(packed: np.ndarray) -> dict[str, Optional[list[int]]]:
    vals, i, out = packed.tolist(), 0, {}
    for name in META_FIELDS:
        if i >= len(vals):
            out[name] = None
            continue
        n = vals[i]
        out[name] = None if n < 0 else vals[i + 1 : i + 1 + n]
        i += 1 + max(n, 0)
    return out


def collect(case: Case, runs: Sequence[RankRun]) -> dict[str, np.ndarray]:
    """Every array a golden holds, from graph-runner runs of the case (runner="graph" or "both")."""
    sc, layout = case.scenario, case.layout
    out: dict[str, np.ndarray] = {}
    for run in runs:
        d = layout.attn_dp_rank(run.rank)
        for it, steps in enumerate(run.graph):
            reqs = sc.iterations[it].per_dp[d]
            base = f"r{run.rank}.i{it}"
            out[f"{base}.requests"] = np.asarray([[r.rid, r.prefix_len, r.accept_len] for r in reqs], dtype=np.int64).reshape(-1, 3)
            recs = run.records[it] if it < len(run.records) else []
            for s, res in enumerate(steps):
                key = f"{base}.s{s}"
                for name in GOLDEN_FLOAT_FIELDS:
                    out[f"{key}.{name}"] = getattr(res.out, name).detach().to(torch.float32).numpy().copy()
                for name in INT_FIELDS:
                    out[f"{key}.{name}"] = getattr(res.out, name).detach().to(torch.int64).numpy().copy()
                rec = recs[s] if s < len(recs) else None
                out[f"{key}.meta"] = pack_meta(_record_meta(rec, int(res.out.rows_fed)))
    return out


def run_for_golden(case: Case, ranks: RanksKind | str = RanksKind.SIM) -> list[RankRun]:
    kind = RanksKind.parse(ranks)
    return ranks_run(case.layout, run_rank, case.scenario, "graph", False, "auto", kind.device, ranks=kind)[0]

