"""Drive the speculative decoding loop (runners.spec_decode) on simulated ranks; the acceptance statistics.

* `SpecSession`: one layout's ranks, each with a `SpecEngine`, stepped together (threads of
  one `SimulatedWorld`; the engines live across steps).
* `Workload`: a case's schedule read as the running batch size of every DP group per phase;
  each phase runs `rounds_per_phase` steps. Requests arrive to fill a group, the oldest are
  finished early to shrink it (so lanes shift and padded lanes go stale), requests also finish
  on their own token budget, and one is preempted and resumed at every phase change.
* `acceptance_stats`: the accept lengths the acceptance goldens hold (harness.golden.acceptance).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from harness.cases.case import Case
from harness.ranks.simulated import SimulatedWorld, one_torch_thread
from harness.ranks.trace import CollectiveCall
from harness.run.kept_outputs import OutputPoison
from harness.run.observe import LoopObserver, LoopRecords
from runners.attention.kinds import TREE_MASK_UNSUPPORTED
from runners.config import DEFAULT_MODEL, ModelConfig, SpecConfig
from runners.parallel.dp_attention import RankContext
from runners.parallel.layout import ParallelLayout
from runners.scheduler import Request
from runners.spec_decode import DEFAULT_ALIGNMENT, Alignment, SpecEngine, StepReport, loop_unsupported_reason
from runners.target import GreedyOutput, target_greedy


def spec_skip_reason(case: Case) -> Optional[str]:
    """Why P2/P5/P6 cannot run this case here (None: they run, with the case's attention backend)."""
    if case.scenario.attention_backend == "flashinfer":
        return TREE_MASK_UNSUPPORTED
    return loop_unsupported_reason(case.scenario.spec)


# ----------------------------------------------------------------------------------------
# sessions
# ----------------------------------------------------------------------------------------


def cheaper_triton_interpreter() -> None:
    """Without a GPU the triton backend's kernels run in Triton's interpreter, thousands of launches and device-function
    calls per session: give it the engine checks' two lookups remembered and its dropped overflow conditions skipped
    (harness.engines.interpreter; the kernels compute the same, and both are idempotent and process-wide)."""
    # imported here: triton is heavy, and runners' launcher must set TRITON_INTERPRET before triton's first import
    from runners.attention import triton_launch

    if triton_launch.INTERPRET:
        from harness.engines.interpreter import remember_interpreter_lookups, skip_dropped_overflow_checks

        remember_interpreter_lookups()
        skip_dropped_overflow_checks()


class SpecSession:
    """A layout's SpecEngines on simulated ranks, stepped together; `hook(engine)` instruments each."""

    def __init__(self, layout: ParallelLayout, spec: SpecConfig, model: ModelConfig = DEFAULT_MODEL, runner: str = "eager",
                 proposer: str = "eagle", alignment: Alignment = DEFAULT_ALIGNMENT, tree: Optional[bool] = None,
                 timeout_s: float = 60.0, hook: Optional[Callable[[SpecEngine], None]] = None, attention_backend: str = "torch",
                 device: str = "cpu", keep_traces: bool = False):
        self.layout, self.spec, self.model, self.alignment = layout, spec, model, alignment
        self.keep_traces = keep_traces
        self.traces: list[list[list[CollectiveCall]]] = []  # keep_traces: per step, per rank, its collective calls (P7)
        self.runner, self.proposer, self.attention_backend = runner, proposer, attention_backend
        if attention_backend == "triton":
            cheaper_triton_interpreter()
        self.world = SimulatedWorld(layout, timeout_s=timeout_s)

        def build(comm):
            e = SpecEngine(RankContext(layout, comm.rank, comm), model, spec, proposer=proposer, runner=runner, tree=tree, alignment=alignment,
                           attention_backend=attention_backend, device=device)
            observer = LoopObserver(e)
            if hook is not None:
                hook(e)
            return e, observer

        with one_torch_thread():
            built = self.world.run(build)
        self.engines: list[SpecEngine] = [e for e, _ in built]
        self.observers: list[LoopObserver] = [o for _, o in built]
        self.output_poison = [OutputPoison(o) for o in self.observers]  # a kept view of a graph output reads poison after its step
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
        for p in self.output_poison:
            p.poison()
        self.reports.append(reps)
        self.records.append([o.take() for o in self.observers])
        if self.keep_traces:
            self.traces.append(self.world.traces)
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


def logprob_params(rid: int, top_logprobs_num: Optional[int]) -> tuple[bool, int]:
    """(return_logprob, top_logprobs_num) of request rid when the workload asks for logprobs (top_logprobs_num not None):
    by rid mod 3, logprobs with the top-k, logprobs alone, none; so a batch mixes all three."""
    if top_logprobs_num is None:
        return False, 0
    return (True, top_logprobs_num) if rid % 3 == 0 else (True, 0) if rid % 3 == 1 else (False, 0)


@dataclass(frozen=True)
class Workload:
    phases: tuple[tuple[int, ...], ...]  # per phase, the running batch size of each DP group
    rounds_per_phase: int = 3
    seed: int = 0
    preempt: bool = True
    top_logprobs_num: Optional[int] = None  # requests ask for logprobs (logprob_params); None: none asks

    @classmethod
    def from_case(cls, case: Case, rounds_per_phase: int = 3) -> "Workload":
        return cls(tuple(tuple(p) for p in case.schedule), rounds_per_phase, case.scenario.seed, top_logprobs_num=case.top_logprobs_num)

    def to_json(self) -> dict:
        out = {"phases": [list(p) for p in self.phases], "rounds_per_phase": self.rounds_per_phase, "seed": self.seed, "preempt": self.preempt}
        if self.top_logprobs_num is not None:
            out["top_logprobs_num"] = self.top_logprobs_num
        return out


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
                    cmds.append(("add", next_rid, prompt, max_new, d, *logprob_params(next_rid, wl.top_logprobs_num)))
                    live.append(next_rid)
                    next_rid += 1
            session.step(cmds)
    return session


# ----------------------------------------------------------------------------------------
# the oracle: target-only greedy at TP1, with the session's weight adjustment
# ----------------------------------------------------------------------------------------


def oracle(session: SpecSession, reqs: Sequence[Request]) -> dict[int, GreedyOutput]:
    """Target-only greedy outputs of these requests, one batch, computed now (never cached across
    calls: under a planted mutant the oracle must be the code as it is now)."""
    reqs = list(reqs)
    if not reqs:
        return {}
    top = max(r.top_logprobs_num for r in reqs)
    top += 1 if top else 0  # one more than asked: whether the last compared entry is a near-tie (harness.props.logprobs)
    with one_torch_thread():
        (outs,) = SimulatedWorld(ParallelLayout()).run(
            lambda comm: target_greedy(session.model, [r.prompt for r in reqs], [r.max_new_tokens for r in reqs],
                                       prepare=session.alignment.apply_target, comm=comm, top_logprobs_num=top))
    return {r.rid: o for r, o in zip(reqs, outs, strict=True)}


# ----------------------------------------------------------------------------------------
# acceptance statistics (the acceptance goldens hold them)
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


def case_session(case: Case, runner: str, proposer: str = "eagle", hook=None, rounds_per_phase: int = 3, device: str = "cpu") -> SpecSession:
    """On a CUDA device the graph runner captures real CUDA graphs (GraphBackend "auto")."""
    sc = case.scenario
    s = SpecSession(sc.layout, sc.spec, sc.model, runner=runner, proposer=proposer, hook=hook, attention_backend=sc.attention_backend,
                    device=device, keep_traces=sc.spec.dp_spec_prefill_coordination)  # mixed DP modes: P7 over every step
    return run_workload(s, Workload.from_case(case, rounds_per_phase))
