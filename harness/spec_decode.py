"""Drive the speculative decoding loop (runners.spec_decode) on simulated ranks; acceptance goldens.

* `SpecSession`: one layout's ranks, each with a `SpecEngine`, stepped together (threads of
  one `SimulatedWorld`; the engines live across steps).
* `Workload`: a case's schedule read as the running batch size of every DP group per phase;
  each phase runs `rounds_per_phase` steps. Requests arrive to fill a group, the oldest are
  finished early to shrink it (so lanes shift and padded lanes go stale), requests also finish
  on their own token budget, and one is preempted and resumed at every phase change.
* Acceptance goldens (P6): golden/acceptance/<case>.json, per request the accept length of
  every verify round and the per-position accept counts. Exact integers; refused when the
  model fingerprint, the alignment, the workload or the spec differ.

    python -m harness.acceptance record [CASE ...]   # regenerate (serially, never under xdist)
    python -m harness.acceptance check  [CASE ...]
"""
from __future__ import annotations

import contextlib
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch

from harness.case import Case, default_cases, load_case
from harness.data import shipped_dir
from harness.observe import LoopObserver, LoopRecords
from harness.ranks.simulated import SimulatedWorld
from runners.attention.flashinfer_backend import TREE_MASK_UNSUPPORTED
from runners.config import DEFAULT_MODEL, ModelConfig, SpecConfig
from runners.parallel.dp_attention import RankContext
from runners.parallel.layout import ParallelLayout
from runners.scheduler import Request
from runners.spec_decode import DEFAULT_ALIGNMENT, Alignment, SpecEngine, StepReport, loop_unsupported_reason
from runners.target import GreedyOutput, target_greedy

ACCEPT_DIR = shipped_dir("golden") / "acceptance"
FORMAT = "specharness-acceptance/1"


def spec_skip_reason(case: Case) -> Optional[str]:
    """Why P2/P5/P6 cannot run this case here (None: they run, with the case's attention backend)."""
    if case.scenario.attention_backend == "flashinfer":
        return TREE_MASK_UNSUPPORTED
    return loop_unsupported_reason(case.scenario.spec)


# every shipped case the loop can run has an acceptance golden
GOLDEN_CASES = tuple(c.name for c in default_cases() if spec_skip_reason(c) is None)


class AcceptanceGoldenError(Exception):
    """Missing, refused or malformed acceptance golden: a message, never a traceback."""


# ----------------------------------------------------------------------------------------
# sessions
# ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Simulated ranks are threads running tiny ops: torch's intra-op pool only spins (measured
    5x the CPU time for the same results on a 2-core machine). Scoped, restored after."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class SpecSession:
    """A layout's SpecEngines on simulated ranks, stepped together; `hook(engine)` instruments each."""

    def __init__(self, layout: ParallelLayout, spec: SpecConfig, model: ModelConfig = DEFAULT_MODEL, runner: str = "eager",
                 proposer: str = "eagle", alignment: Alignment = DEFAULT_ALIGNMENT, tree: Optional[bool] = None,
                 timeout_s: float = 60.0, hook: Optional[Callable[[SpecEngine], None]] = None, attention_backend: str = "torch"):
        self.layout, self.spec, self.model, self.alignment = layout, spec, model, alignment
        self.runner, self.proposer, self.attention_backend = runner, proposer, attention_backend
        self.world = SimulatedWorld(layout, timeout_s=timeout_s)

        def build(comm):
            e = SpecEngine(RankContext(layout, comm.rank, comm), model, spec, proposer=proposer, runner=runner, tree=tree, alignment=alignment,
                           attention_backend=attention_backend)
            observer = LoopObserver(e)
            if hook is not None:
                hook(e)
            return e, observer

        with one_torch_thread():
            built = self.world.run(build)
        self.engines: list[SpecEngine] = [e for e, _ in built]
        self.observers: list[LoopObserver] = [o for _, o in built]
        self.reports: list[list[StepReport]] = []  # per step, per rank
        self.records: list[list[LoopRecords]] = []  # per step, per rank: the graph replays P1 reads

    def step(self, commands: Sequence[tuple] = ()) -> list[StepReport]:
        """Apply the commands on every rank (each keeps its DP group's), then one engine step."""

        def fn(comm):
            e = self.engines[comm.rank]  # the engine's own communicator: same world, same rank
            for name, *args in commands:
                getattr(e, name)(*args)
            return e.step()

        with one_torch_thread():
            reps = self.world.run(fn)
        self.reports.append(reps)
        self.records.append([o.take() for o in self.observers])
        return reps

    def leader(self, dp_rank: int) -> SpecEngine:
        return self.engines[dp_rank * self.layout.attn_tp_size]

    def requests(self) -> dict[int, Request]:
        out: dict[int, Request] = {}
        for d in range(self.layout.attn_dp_size):
            out.update(self.leader(d).requests())
        return out

    def running(self, dp_rank: int) -> list[Request]:
        return list(self.leader(dp_rank).sched.running)

    def waiting(self, dp_rank: int) -> list[Request]:
        return list(self.leader(dp_rank).sched.waiting)


def request_prompt(seed: int, rid: int, vocab: int) -> tuple[tuple[int, ...], int]:
    """A request's prompt (5..16 tokens) and token budget (8..16), from (seed, rid) alone."""
    h = zlib.crc32(f"spec:{seed}:{rid}".encode())
    g = torch.Generator().manual_seed(h)
    return tuple(torch.randint(0, vocab, (5 + h % 12,), generator=g).tolist()), 8 + (h >> 8) % 9


# ----------------------------------------------------------------------------------------
# workloads
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    phases: tuple[tuple[int, ...], ...]  # per phase, the running batch size of each DP group
    rounds_per_phase: int = 3
    seed: int = 0
    preempt: bool = True

    @classmethod
    def from_case(cls, case: Case, rounds_per_phase: int = 3) -> "Workload":
        return cls(tuple(tuple(p) for p in case.schedule), rounds_per_phase, case.scenario.seed)

    def to_json(self) -> dict:
        return {"phases": [list(p) for p in self.phases], "rounds_per_phase": self.rounds_per_phase, "seed": self.seed, "preempt": self.preempt}


def run_workload(session: SpecSession, wl: Workload) -> SpecSession:
    next_rid, to_resume = 0, []
    for p, sizes in enumerate(wl.phases):
        for k in range(wl.rounds_per_phase):
            cmds: list[tuple] = [("resume", rid) for rid in to_resume]
            resumed, to_resume = set(to_resume), []
            for d, want in enumerate(sizes):
                live = [r.rid for r in session.running(d)] + [r.rid for r in session.waiting(d) if r.rid in resumed]
                if wl.preempt and k == 0 and p > 0 and d == 0 and len(live) >= 2:
                    victim = live.pop(len(live) // 2)  # a lane in the middle: the lanes behind it shift
                    cmds.append(("preempt", victim))
                    to_resume.append(victim)
                while len(live) > want:  # shrink: the oldest requests finish early
                    cmds.append(("finish", live.pop(0)))
                while len(live) < want:
                    prompt, max_new = request_prompt(wl.seed, next_rid, session.model.vocab_size)
                    cmds.append(("add", next_rid, prompt, max_new, d))
                    live.append(next_rid)
                    next_rid += 1
            session.step(cmds)
    return session


# ----------------------------------------------------------------------------------------
# the oracle (P5): target-only greedy at TP1, with the session's weight adjustment
# ----------------------------------------------------------------------------------------


def oracle(session: SpecSession, reqs: Sequence[Request]) -> dict[int, GreedyOutput]:
    """Target-only greedy outputs of these requests, one batch, computed now (never cached across
    calls: under a planted mutant the oracle must be the code as it is now)."""
    reqs = list(reqs)
    if not reqs:
        return {}
    with one_torch_thread():
        (outs,) = SimulatedWorld(ParallelLayout()).run(
            lambda comm: target_greedy(session.model, [r.prompt for r in reqs], [r.max_new_tokens for r in reqs],
                                       prepare=session.alignment.apply_target, comm=comm))
    return {r.rid: o for r, o in zip(reqs, outs, strict=True)}


# ----------------------------------------------------------------------------------------
# acceptance statistics and goldens (P6)
# ----------------------------------------------------------------------------------------


def position_accepts(accept_lens: Sequence[int], num_steps: int) -> list[int]:
    """Per draft position 1..S: the rounds in which the draft token at that depth was accepted."""
    return [sum(1 for a in accept_lens if a - 1 >= k) for k in range(1, num_steps + 1)]


def acceptance_stats(session: SpecSession) -> dict:
    S = session.spec.num_steps
    reqs = session.requests()
    per = {}
    for rid in sorted(reqs):
        r = reqs[rid]
        per[str(rid)] = {"accept_lens": list(r.accept_lens), "position_accepts": position_accepts(r.accept_lens, S),
                         "sibling_accepts": int(sum(r.sibling_accepts))}
    all_lens = [a for r in reqs.values() for a in r.accept_lens]
    rounds = len(all_lens)
    summary = {
        "steps": len(session.reports),
        "verify_rounds": rounds,
        "requests": len(reqs),
        "mean_accept_len": round(sum(all_lens) / rounds, 4) if rounds else 0.0,
        "position_accept_rate": [round(sum(p["position_accepts"][k] for p in per.values()) / rounds, 4) if rounds else 0.0 for k in range(S)],
        "sibling_accepts": sum(p["sibling_accepts"] for p in per.values()),
    }
    return {"requests": per, "summary": summary}


def case_session(case: Case, runner: str, proposer: str = "eagle", hook=None, rounds_per_phase: int = 3) -> SpecSession:
    sc = case.scenario
    s = SpecSession(sc.layout, sc.spec, sc.model, runner=runner, proposer=proposer, hook=hook, attention_backend=sc.attention_backend)
    return run_workload(s, Workload.from_case(case, rounds_per_phase))


def golden_identity(case: Case, wl: Workload, alignment: Alignment = DEFAULT_ALIGNMENT) -> dict:
    sc = case.scenario
    spec = sc.spec
    return {
        "fingerprint": sc.model.fingerprint(),
        "alignment": alignment.to_json(),
        "workload": wl.to_json(),
        "spec": {"num_steps": spec.num_steps, "topk": spec.topk, "num_tokens_per_bs": spec.num_tokens_per_bs, "capture_bs": list(spec.capture_bs),
                 "max_running_requests": spec.max_running_requests, "page_size": spec.page_size,
                 **({"draft": spec.draft} if spec.draft != "multi_layer" else {})},
        "layout": sc.layout.describe(),
    }


def golden_path(name: str) -> Path:
    return ACCEPT_DIR / f"{name}.json"


def load_acceptance_golden(case: Case, wl: Optional[Workload] = None) -> dict:
    """The case's golden, or AcceptanceGoldenError naming what is missing or differs."""
    path = golden_path(case.name)
    if not path.exists():
        raise AcceptanceGoldenError(f"{path}: no acceptance golden for case {case.name!r}; record it: python -m harness.acceptance record {case.name}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AcceptanceGoldenError(f"{path}: not valid JSON ({e})") from None
    if data.get("format") != FORMAT:
        raise AcceptanceGoldenError(f"{path}: format {data.get('format')!r}, expected {FORMAT!r}")
    want = golden_identity(case, wl or Workload.from_case(case))
    diff = [k for k in want if data.get(k) != want[k]]
    if diff:
        detail = "; ".join(f"{k}: golden {data.get(k)!r}, case {want[k]!r}" for k in diff)
        raise AcceptanceGoldenError(f"{path}: refused, recorded for another model or setup ({detail}); re-record it")
    return data


def record(names: Sequence[str] = GOLDEN_CASES, say: Callable[[str], None] = print) -> list[Path]:
    """Record from the eager runner; refuse if the graph runner's acceptance differs (it must not)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        raise AcceptanceGoldenError("acceptance goldens are recorded serially, never under pytest-xdist")
    paths = []
    for name in names:
        case = load_case(name)
        wl = Workload.from_case(case)
        eager = acceptance_stats(case_session(case, "eager"))
        graph = acceptance_stats(case_session(case, "graph"))
        if eager["requests"] != graph["requests"]:
            raise AcceptanceGoldenError(f"{name}: eager and graph runners accept differently; not recording (run the P6 check to see where)")
        ACCEPT_DIR.mkdir(parents=True, exist_ok=True)
        data = {"format": FORMAT, "case": name, **golden_identity(case, wl), **eager}
        path = golden_path(name)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
        os.replace(tmp, path)
        s = eager["summary"]
        say(f"{name}: {s['verify_rounds']} verify rounds, mean accept length {s['mean_accept_len']}, per position {s['position_accept_rate']} -> {path}")
        paths.append(path)
    return paths
