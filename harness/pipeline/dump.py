"""`harness replay <case> --dump DIR`: every rank's buffers and metadata at one (iteration, step).

The case is rerun on simulated ranks up to the target iteration, and then, per rank:

    DIR/rank{r}.npz      np.load-able; keys
                           inputs.<name>              the live batch this rank got (input_ids, positions, seq_lens, ...)
                           eager.s{k}.<field>         eager outputs of step k (logits, hidden, logprobs, topk_p, topk_index, ...)
                           graph.s{k}.<field>         graph outputs of step k, sliced to the real rows
                           buffers.s{k}.<name>        the graph runners' static buffers after the iteration, padded lanes included
                           meta.eager.s{k}.<name>     host metadata of the eager ForwardBatch (ints; -1: None)
                           meta.graph.s{k}.<field>    the replay's record (harness.run.records.ReplayRecord), by field name: bucket,
                                                      replay fill, rows fed; capture.<field> the bucket as baked,
                                                      capture.host.<name> its host metadata
    DIR/oracle.npz       the TP1 eager oracle of the same iteration (eager.s{k}.<field>, rids)
    DIR/divergence.json  the case, layout, target, the first divergence and, per rank, its requests

The multi-layer steps share one input-buffer set (as the engine's multi-step runner does), so
every step's `buffers.s{k}` holds the iteration's last state: the last step's inputs, and the
padded lanes as the replay fill left them.
"""
from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from harness.cases.case import Case
from harness.ranks import run as ranks_run
from harness.ranks.simulated import RankFailure
from harness.run.records import ReplayRecord
from harness.run.rig import Rig, RunnerChoice

BUFFERS = ("input_ids", "positions", "out_cache_loc", "seq_lens", "req_pool_indices", "num_correct_drafts", "num_accept_tokens",
           "extend_seq_lens", "extend_start_loc", "hidden_states", "next_token_logits_buffer", "global_num_tokens_gpu",
           "global_num_tokens_for_logprob_gpu")
INPUTS = ("input_ids", "positions", "seq_lens", "req_pool_indices", "hidden_states", "accept_lens")


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").clone().numpy()


def _meta(d: dict, prefix: str) -> dict[str, np.ndarray]:
    out = {}
    for k, v in d.items():
        if isinstance(v, bool) or isinstance(v, int):
            out[f"{prefix}.{k}"] = np.asarray([int(v)], dtype=np.int64)
        elif v is None:
            out[f"{prefix}.{k}"] = np.asarray([-1], dtype=np.int64)
        elif isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v):
            out[f"{prefix}.{k}"] = np.asarray(v, dtype=np.int64)
    return out


def _record_fields(rec: ReplayRecord) -> dict:
    """The record flattened under its own field names (one name per value, as in the record)."""
    cap = rec.capture
    out = {f.name: getattr(rec, f.name) for f in fields(rec) if f.name != "capture"}
    out.update({f"capture.{f.name}": getattr(cap, f.name) for f in fields(cap) if f.name != "host"})
    out.update({f"capture.host.{name}": v for name, v in cap.host.items()})
    return out


def _dump_rank(comm, case: Case, target_it: int, runner: RunnerChoice) -> dict[str, np.ndarray]:
    rig = Rig(comm, case.scenario, runner)
    out: dict[str, np.ndarray] = {}
    if not rig.holds_draft:
        return out  # no draft on this rank (SpecConfig.draft_tp_size): nothing of the draft-extend to dump
    for it in range(target_it + 1):
        run = rig.iteration(it)
        if it < target_it:
            continue
        out.update({f"inputs.{n}": _np(getattr(run.inputs, n)) for n in INPUTS})
        out["inputs.rids"] = np.asarray(run.rids, dtype=np.int64)
        out["inputs.dp_batch_sizes"] = np.asarray(run.inputs.dp_batch_sizes, dtype=np.int64)
        for k, (o, host) in enumerate(zip(run.eager or [], run.eager_host, strict=True)):
            out.update({f"eager.s{k}.{n}": _np(t) for n, t in o.tensors().items()})
            out.update(_meta(host, f"meta.eager.s{k}"))
        for k, o in enumerate(run.graph or []):
            out.update({f"graph.s{k}.{n}": _np(t) for n, t in o.tensors().items()})
        for k, r in enumerate(rig.driver.runners if rig.driver is not None else []):
            for name in BUFFERS:
                buf = getattr(r, name, None)
                if isinstance(buf, torch.Tensor):
                    out[f"buffers.s{k}.{name}"] = _np(buf)
        for k, rec in enumerate(run.records):
            out.update(_meta(_record_fields(rec), f"meta.graph.s{k}"))
    return out


def target_of(divergence: Optional[dict], step: Optional[int]) -> tuple[int, int, str]:
    """(iteration, step, why) to dump: the first divergence's, else iteration 0 at --step (or 0)."""
    if divergence:
        w = divergence.get("where", {})
        it, s = w.get("iteration"), w.get("step")
        if isinstance(it, int):
            return it, s if isinstance(s, int) else 0, f"first divergence ({divergence['property']}/{divergence['check']} {divergence['field']})"
        return 0, s if isinstance(s, int) else 0, f"first divergence ({divergence['property']}/{divergence['check']}, no iteration named: iteration 0)"
    return 0, step or 0, "no divergence: iteration 0" + (f", step {step}" if step is not None else "")


def dump_case(case: Case, directory: Path | str, iteration: int, step: int, runner: RunnerChoice = "both", why: str = "",
              divergence: Optional[dict] = None) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    sc = case.scenario
    iteration = min(max(iteration, 0), len(sc.iterations) - 1)
    info = {"case": case.name, "path": case.path, "layout": sc.layout.describe(), "branch": sc.layout.branch.value, "runner": runner,
            "iteration": iteration, "step": step, "why": why, "first_divergence": divergence, "files": {}}
    try:
        per_rank = ranks_run(sc.layout, _dump_rank, case, iteration, runner)[0]
    except RankFailure as err:
        info["error"] = str(err).splitlines()[0]
        per_rank = []
    for r, arrays in enumerate(per_rank):
        np.savez(d / f"rank{r}.npz", **arrays)
        info["files"][f"rank{r}.npz"] = {"rank": r, "attn_dp_rank": sc.layout.attn_dp_rank(r), "rids": arrays.get("inputs.rids", np.zeros(0)).tolist(),
                                         "keys": len(arrays)}
    if not info.get("error"):
        tp1 = replace(case, scenario=sc.as_tp1())
        oracle = ranks_run(tp1.layout, _dump_rank, tp1, iteration, "eager")[0][0]
        np.savez(d / "oracle.npz", **{k: v for k, v in oracle.items() if k.startswith(("eager.", "inputs."))})
        info["files"]["oracle.npz"] = {"rank": "TP1 eager oracle", "rids": oracle["inputs.rids"].tolist(), "keys": len(oracle)}
    (d / "divergence.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    return d
