"""Plant each mutant in a child process, run the probes that can see it, report who killed it.

Killed means a property reported a failure. A collective timeout is not a kill (a hang
caught by a deadline says nothing about which property sees the bug), and neither is a
probe that raised, nor a child process that died or overran its time: those are errors,
so they can't pass for a kill.

Which probes: a mutant names the probes that can see it (`Mutant.probes`, cheapest first; unset: every probe, the
costly ones last). The probes are the registered properties' (harness.props.registry) and the case probes below, which
run the case pipeline with every property of one case run over named cases, so a new such property is probed with no
edit here. A probe made of parts (Probe.of: one case or run each) runs part by part, so a mutant pays for the parts up
to the one that kills it, and a mutant that one part sees names that part.
By default a mutant stops at the first probe that kills it; the report then names the killing property and probe and
lists the probes it did not run, so it never claims the other properties were checked.
`all_properties=True` runs every listed probe: the full kill matrix; `every_probe=True` ignores the lists (every
registered probe), to re-derive them when the runners change.

Why one process per mutant and not a ProcessPoolExecutor: a pool cannot stop one overlong task, and a worker that dies
breaks every pending future, so the crash could not be pinned on its mutant. Each child is forked from this process
once it has imported torch, the harness, the catalog and every property (a fork costs milliseconds, those imports
seconds), so a mutant's cost is its probes'. A patch, and whatever state the mutated code leaves behind, lives and dies
with its child's copy of memory: the parent never runs mutated code and no child sees another's. A child runs torch on
one thread: an OpenMP pool the parent started (a test process has) does not survive a fork, and on tensors this small
more threads only spin (simulated ranks are threads already). Each probe's CPU time is in the result (`probes`), so a
mutant's order can be checked against what its probes cost.
"""
from __future__ import annotations

import gc
import importlib
import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from harness.cases.case import Case, load_case
from harness.cases.template import case_toml, validate_text
from harness.mutants import Mutant
from harness.pipeline.check import check_case
from harness.props import registry
from harness.props.base import Probe
from harness.props.p5 import PLANNED_CASES
from harness.verdict import Verdict, merge_verdicts
from runners.config import ModelConfig, SpecConfig
from runners.parallel.layout import ParallelLayout

CATALOG_REF = "harness.mutants:CATALOG"  # "module:attribute"
DEFAULT_TIMEOUT_S = 300.0
HEARTBEAT_S = 30.0

# ---- the case probes: the case pipeline (every property of one case run) over named cases ----

# One per branch family plus the shrink and idle-rank schedules, world sizes 1..8, DP attention in every branch.
# `harness check` runs all shipped cases (world 16 and 32 too); the mutant run takes this subset: it is the costliest
# probe, so mutants list it last.
MUTANT_CASES = (
    "tp1_neither",
    "tp2_shrink",
    "tp2_dp2_mlp_dp_lm_head",
    "tp4_attn_tp_gather",
    "tp4_dp2_mlp_tp_gather",
    "tp4_dp2_attn_tp_gather",
    "tp8_dp4_mlp_idle_rank",
    "tp4_dp4_neither",  # DP attention without gathered counts: the eager pass must not be MLP-sync padded
)


def single_group_case() -> Case:
    """SGLang's EAGLE3 draft under DP attention (DraftTPExecution.SINGLE_GROUP): plain TP over each attention-TP group,
    draft_tp_size = attn_tp_size = 2 under TP4 DP2, no collective across DP groups. Not shipped (no goldens): P1, P3 and
    P4 against the TP1 run of the same weights see a draft collective over the wrong ranks."""
    spec = SpecConfig(num_steps=3, topk=1, capture_bs=(1, 2, 4), max_running_requests=4, draft="eagle3",
                      eagle_aux_hidden_state_layer_ids=(0, 1, 2), draft_vocab_size=256, draft_tp_size=2)
    text = case_toml("tp4_dp2_eagle3_single_group", "TP4 DP2, the EAGLE3 draft at TP2 inside each attention-TP group",
                     ParallelLayout(tp_size=4, dp_size=2, enable_dp_attention=True), spec, [[3, 1], [1, 2]],
                     model=ModelConfig(num_target_layers=4, num_kv_heads=8), max_prefix_len=16)
    return validate_text(text, Path("<tp4_dp2_eagle3_single_group>"))


def _case_probe(probe_id: str, case: Callable[[], Case]) -> Probe:
    return Probe(probe_id, lambda: check_case(case()).verdicts)


def _guarded_case_probe(probe_id: str, case: Callable[[], Case]) -> Probe:
    """A case probe whose case is built here (an exception building it, or running the draft's own placement, is a
    "run" failure naming the probe)."""
    return Probe.guarded(probe_id, lambda: check_case(case()).verdicts)


CASE_PROBES_TP1 = _case_probe("case-tp1", lambda: load_case(MUTANT_CASES[0]))  # the smallest: the multi-layer draft-extend runner

# The features' cases, one case run each (P1, P3, P4 of the draft-extend runners against the TP1 run of the same
# weights): the EAGLE3 draft and the draft at a TP size of its own (shipped, and SGLang's placement under DP attention);
# vLLM's padding convention and its shapes of the draft-extend. harness.mutants.eagle3, draft_parallel and vllm_shapes
# name them.
CASE_PROBES = (
    CASE_PROBES_TP1,
    # the one-graph composite's case (a shrink: padded lanes in every bucket but the first)
    _case_probe("case-one-graph", lambda: load_case("tp2_shrink_one_graph")),
    _guarded_case_probe("eagle3-case", lambda: load_case("tp2_dp2_eagle3")),
    _guarded_case_probe("draft-tp-case", lambda: load_case("tp4_dp2_eagle3_draft_tp1")),
    _guarded_case_probe("draft-tp-group", single_group_case),
    _case_probe("case-pad-minus-one", lambda: load_case("tp2_dp2_pad_minus_one")),
    _case_probe("case-ragged", lambda: load_case("tp2_ragged_draft_extend")),
    _case_probe("case-piecewise", lambda: load_case("tp2_piecewise")),
    # the torch_planned backend: every replay planned from its own buffers, against the eager passes (P1, P3, P4)
    Probe.of("planned-cases", tuple(_guarded_case_probe(f"planned-cases:{name}", lambda name=name: load_case(name)) for name in PLANNED_CASES)),
    # a part per case; the smallest is case-tp1
    Probe.of("cases", (CASE_PROBES_TP1, *(_case_probe(f"cases:{name}", lambda name=name: load_case(name)) for name in MUTANT_CASES[1:])),
             costly=True),
)


def probes() -> tuple[Probe, ...]:
    """Every probe a mutant can name: the properties' (registry order), then the case probes; a probe made of parts
    (Probe.of) is followed by its parts."""
    return registry.unique_probes(registry.probes() + CASE_PROBES)


@dataclass
class ProbeRun:
    """One probe run with a mutant planted: its CPU time (every thread of the process: simulated ranks included) and
    the properties its own verdicts failed (empty: it did not see the mutant)."""
    probe: str
    cpu_seconds: float
    failed: list[str] = field(default_factory=list)
    error: str = ""  # the probe raised: never a kill

    def to_json(self) -> dict:
        return {"probe": self.probe, "cpu_seconds": round(self.cpu_seconds, 3), "failed": self.failed, "error": self.error}


@dataclass
class MutantResult:
    id: str
    description: str
    killed: bool
    killed_by: Optional[str]
    seconds: float
    failed_properties: list[str] = field(default_factory=list)
    first_failure: str = ""
    timeouts: int = 0
    killing_probe: Optional[str] = None
    probes: list[ProbeRun] = field(default_factory=list)  # in run order
    probes_not_run: list[str] = field(default_factory=list)  # listed for the mutant, skipped after the first kill
    error: str = ""  # a probe raised, or the child died or overran: never a kill

    @property
    def status(self) -> str:
        return "killed" if self.killed else "error" if self.error else "survived"

    @property
    def probes_run(self) -> list[str]:
        return [p.probe for p in self.probes]

    @property
    def cpu_seconds(self) -> float:
        return sum(p.cpu_seconds for p in self.probes)

    def to_json(self) -> dict:
        return {
            "id": self.id, "description": self.description, "status": self.status, "killed": self.killed, "killed_by": self.killed_by,
            "killing_probe": self.killing_probe, "seconds": round(self.seconds, 2), "cpu_seconds": round(self.cpu_seconds, 2),
            "failed_properties": self.failed_properties, "first_failure": self.first_failure, "probes_run": self.probes_run,
            "probes_not_run": self.probes_not_run, "probes": [p.to_json() for p in self.probes], "error": self.error,
        }


def _is_timeout(v: Verdict) -> bool:
    return bool(v.failures) and all(f.check == "run" and f.got == "CollectiveTimeout" for f in v.failures)


def _killing(verdicts: dict[str, Verdict]) -> list[str]:
    """The properties that failed, in kill order (a property that saw the bug before the crash it caused: "run" last)."""
    return [p for p in registry.kill_order() if p in verdicts and not verdicts[p].ok and not _is_timeout(verdicts[p])]


def load_catalog(ref: str = CATALOG_REF) -> tuple[Mutant, ...]:
    module, _, attr = ref.partition(":")
    return tuple(getattr(importlib.import_module(module), attr))


def probes_for(m: Mutant, every_probe: bool = False) -> list[Probe]:
    """The probes that run for m, in its order: each named probe, or the parts of one made of parts (Probe.of), each
    once. every_probe: every probe that has no parts, those of the costly ones last. Every name must be registered."""
    known = {p.id: p for p in probes()}
    if m.probes is not None and not every_probe:
        unknown = [n for n in m.probes if n not in known]
        if unknown or not m.probes:
            raise KeyError(f"mutant {m.id}: probes {unknown or list(m.probes)!r} not registered; known: {', '.join(known)}")
        named = [known[n] for n in m.probes]
    else:
        costly = {leaf.id for p in known.values() if p.costly for leaf in p.leaves()}
        leaves = [p for p in known.values() if not p.parts]
        named = [p for p in leaves if p.id not in costly] + [p for p in leaves if p.id in costly]
    return list({leaf.id: leaf for p in named for leaf in p.leaves()}.values())


def run_mutant(m: Mutant, all_properties: bool = False, every_probe: bool = False) -> MutantResult:
    """Plant m in this process and run its probes (the child's job; also usable in-process)."""
    t0 = time.perf_counter()
    chosen = probes_for(m, every_probe)
    verdicts: dict[str, Verdict] = {}
    runs: list[ProbeRun] = []
    killing_probe = None
    with m.planted():
        for probe in chosen:
            cpu0 = time.process_time()
            try:
                out = probe.run()
            except Exception as err:  # noqa: BLE001 - reported as an error, never as a kill
                runs.append(ProbeRun(probe.id, time.process_time() - cpu0, error=f"probe {probe.id} raised {type(err).__name__}: {err}"))
                continue
            runs.append(ProbeRun(probe.id, time.process_time() - cpu0, _killing(out)))
            merge_verdicts(verdicts, out)
            if killing_probe is None and runs[-1].failed:
                killing_probe = probe.id
                if not all_properties:
                    break
    failed = _killing(verdicts)
    ran = {r.probe for r in runs}
    return MutantResult(
        m.id, m.description, bool(failed), failed[0] if failed else None, time.perf_counter() - t0, failed,
        verdicts[failed[0]].first() if failed else "", sum(1 for v in verdicts.values() if _is_timeout(v)),
        killing_probe, runs, [p.id for p in chosen if p.id not in ran], "; ".join(r.error for r in runs if r.error),
    )


def _child(m: Mutant, all_properties: bool, every_probe: bool, conn: Connection) -> None:
    """A forked child: plants m, runs its probes, sends the result. Its stdout is the parent's stderr, so nothing a
    probe prints reaches the report (under --json, stdout holds one JSON document). multiprocessing flushed both
    streams before the fork, so nothing of the parent's is written twice."""
    os.dup2(2, 1)  # by descriptor: sys.stderr may be a capture without one (pytest's capsys)
    sys.stdout = sys.stderr
    torch.set_num_threads(1)  # see the module's docstring
    try:
        result = run_mutant(m, all_properties, every_probe)
    except Exception as err:  # noqa: BLE001 - e.g. a patch target that moved: an error for this mutant
        result = MutantResult(m.id, m.description, False, None, 0.0, error=f"{type(err).__name__}: {err}")
    conn.send(result)
    conn.close()


@dataclass
class _Job:
    mutant: Mutant
    proc: mp.process.BaseProcess
    conn: Connection
    t0: float


def _died(job: _Job) -> str:
    job.proc.join(5)
    code = job.proc.exitcode
    how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
    return f"child process for mutant {job.mutant.id} died ({how}) before reporting"


def _finish(job: _Job, timeout_s: float) -> Optional[MutantResult]:
    """The job's result if it is over (reported, died or overran), else None."""
    m, elapsed = job.mutant, time.perf_counter() - job.t0
    if job.conn.poll():
        try:
            result = job.conn.recv()
        except (EOFError, OSError):  # readable because the child closed its end without sending
            result = MutantResult(m.id, m.description, False, None, elapsed, error=_died(job))
        job.proc.join(5)
        return result
    if not job.proc.is_alive():
        return MutantResult(m.id, m.description, False, None, elapsed, error=_died(job))
    if elapsed > timeout_s:
        job.proc.kill()
        job.proc.join(5)
        return MutantResult(m.id, m.description, False, None, elapsed, error=f"mutant {m.id} overran its {timeout_s:.0f}s timeout and was stopped")
    return None


def run_catalog(
    only: Optional[Sequence[str]] = None,
    on_result: Optional[Callable[[MutantResult], None]] = None,
    *,
    jobs: Optional[int] = None,
    all_properties: bool = False,
    every_probe: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    on_progress: Optional[Callable[[str], None]] = None,
    catalog: str = CATALOG_REF,
) -> list[MutantResult]:
    """Run the chosen mutants, `jobs` child processes at a time (default: one per core).

    on_result sees each result as it completes; the return value is in catalog order.
    """
    mutants = load_catalog(catalog)
    unknown = set(only or ()) - {m.id for m in mutants}
    if unknown:
        raise KeyError(f"unknown mutant(s): {', '.join(sorted(unknown))}; known: {', '.join(m.id for m in mutants)}")
    chosen = [m for m in mutants if only is None or m.id in only]
    for m in chosen:
        probes_for(m)  # a misnamed probe fails here, before any child starts; and every property is imported once, here
    if not chosen:
        return []
    cores = os.cpu_count() or 1
    jobs = max(1, min(jobs or cores, len(chosen)))
    ctx = mp.get_context("fork")
    # what the parent imported is never garbage: frozen, a child's full collections skip it (and its pages stay shared)
    gc.collect()
    gc.freeze()
    pending, running, done = list(chosen), [], {}
    t_start = last_news = time.perf_counter()
    try:
        while pending or running:
            while pending and len(running) < jobs:
                m = pending.pop(0)
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_child, args=(m, all_properties, every_probe, send), name=f"mutant-{m.id}", daemon=True)
                proc.start()
                send.close()  # the child holds the only write end: EOF on our side means it died
                running.append(_Job(m, proc, recv, time.perf_counter()))
            wait([j.conn for j in running] + [j.proc.sentinel for j in running], timeout=1.0)
            for job in list(running):
                result = _finish(job, timeout_s)
                if result is None:
                    continue
                running.remove(job)
                job.conn.close()
                done[result.id] = result
                last_news = time.perf_counter()
                if on_result:
                    on_result(result)
            if on_progress and running and time.perf_counter() - last_news > HEARTBEAT_S:
                now = last_news = time.perf_counter()
                busy = ", ".join(f"{j.mutant.id} {now - j.t0:.0f}s" for j in running)
                on_progress(f"{now - t_start:.0f}s: {len(done)}/{len(chosen)} done; running {busy}; {len(pending)} queued")
    finally:
        for job in running:  # interrupted (Ctrl-C): leave no child behind
            job.proc.kill()
            job.proc.join(5)
    return [done[m.id] for m in chosen]
