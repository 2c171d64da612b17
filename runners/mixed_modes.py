"""Mixed forward modes across DP ranks in one iteration: SGLang's DP spec/prefill coordination.

Under DP attention every DP group schedules its own batch, so in one iteration one group may prefill a new request
(EXTEND) while another verifies its running ones (TARGET_VERIFY) and a third has nothing to run (IDLE). SGLang's
scheduler gathers, per DP group, its token count, its logprob token count and its forward mode in one all_gather
(managers/scheduler_components/dp_attn.py, MLPSyncBatchInfo); every rank then knows is_extend_in_batch. With
SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION the speculative worker runs such a step with each rank's LOCAL mode
deciding what it computes (speculative/eagle_worker_v2.py _forward_dp_spec_prefill_coordination): the extending group
its target EXTEND and the draft's prefill, the decoding group its verify and draft-extend, the idle group the same
passes over nothing. The GATHERED modes decide how every rank joins the collectives:

- every group's token count comes from the gather (an extending group its prompt tokens, a decoding one bs *
  num_draft_tokens), and the padding mode from is_extend_in_batch: SUM_LEN (layers/dp_attention.py
  get_dp_padding_mode), the groups' rows concatenated, so a decoding group is not padded to a prompt's length;
- no rank replays a graph (speculative/dp_spec_prefill_coordination.py clears can_run_decode_cuda_graph on every
  rank): a graph's collectives have its bucket's MAX_LEN shapes, and the extending group's eager pass has others.

An iteration whose gathered modes hold no EXTEND is a plain decode step: graphs as usual, MAX_LEN. A group with new
and running requests prefills first; its running ones wait the iteration (SGLang runs a prefill batch first). The
draft passes of a mixed iteration are DRAFT_EXTEND_V2 lanes of num_draft_tokens rows on every group (our draft's
prefill runs in such lanes too), padded and gathered as the draft's eager passes always are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from runners.batch import ForwardMode
from runners.parallel.comm import Group
from runners.parallel.dp_attention import RankContext
from runners.parallel.layout import DpPaddingMode
from runners.scheduler import Request, Scheduler

LOCAL_MODES = (ForwardMode.IDLE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY)  # what a DP group runs; gathered as the index


@dataclass(frozen=True)
class MlpSyncInfo:
    """What the iteration's one all_gather tells every DP group about every other."""

    num_tokens: tuple[int, ...]  # per DP group: the tokens of its target pass
    num_tokens_for_logprob: tuple[int, ...]  # per DP group: the rows its target pass gives lm_head
    forward_modes: tuple[ForwardMode, ...]  # per DP group: IDLE, EXTEND or TARGET_VERIFY

    @property
    def is_extend_in_batch(self) -> bool:
        return ForwardMode.EXTEND in self.forward_modes


def gather_mlp_sync_info(ctx: RankContext, num_tokens: int, num_tokens_for_logprob: int, mode: ForwardMode,
                         device: torch.device) -> MlpSyncInfo:
    """One all_gather over the DP groups (idle groups too: a group that skips it hangs the others)."""
    if not ctx.layout.require_mlp_sync or ctx.layout.attn_dp_size == 1:
        return MlpSyncInfo((num_tokens,), (num_tokens_for_logprob,), (mode,))
    local = torch.tensor([num_tokens, num_tokens_for_logprob, LOCAL_MODES.index(mode)], dtype=torch.int64, device=device)
    rows = ctx.comm.all_gather(local, Group.ATTN_DP).view(-1, 3).tolist()
    return MlpSyncInfo(tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(LOCAL_MODES[r[2]] for r in rows))


@dataclass(frozen=True)
class DpIteration:
    """This rank's view of one iteration: its own mode (what it computes) and the gathered one (how it joins)."""

    forward_mode: ForwardMode
    sync: MlpSyncInfo
    dp_rank: int

    def padding_mode(self) -> DpPaddingMode:
        return DpPaddingMode.SUM_LEN if self.sync.is_extend_in_batch else DpPaddingMode.MAX_LEN

    def can_run_graph(self) -> bool:
        return not self.sync.is_extend_in_batch

    def dp_tokens(self) -> list[int]:
        """Every group's token count of the target pass: what sizes its collectives on every rank."""
        return list(self.sync.num_tokens)

    def runs_prefill(self) -> bool:
        """Which passes this group runs: its own mode decides (an idle group joins the extending groups' passes, or the
        decoding groups' when none extends). Routed on the gathered flag, a decoding group would prefill nothing and
        skip its verify whenever another group extends."""
        return self.forward_mode is ForwardMode.EXTEND or (self.forward_mode is ForwardMode.IDLE and self.sync.is_extend_in_batch)


@dataclass(frozen=True)
class PhaseSync:
    """How a rank runs the iteration's target pass and draft passes, decided from the gathered modes: every group's
    token count, the padding mode, whether a graph may replay. The engine's passes take it instead of syncing again."""

    dp_tokens: list[int]
    padding: DpPaddingMode
    graphs: bool

    @classmethod
    def of(cls, it: DpIteration) -> "PhaseSync":
        return cls(it.dp_tokens(), it.padding_mode(), it.can_run_graph())


class StepModes(Protocol):
    dp_forward_modes: list[str]


class CoordinatedEngine(Protocol):
    """What a coordinated step needs of the engine (runners.spec_decode.SpecEngine): its group's requests, the passes
    of each mode, taking the iteration's PhaseSync."""

    ctx: RankContext
    device: torch.device
    T: int
    sched: Scheduler

    def prefill_len(self, r: Request) -> int: ...

    def prefill(self, fresh: list[Request], rep: StepModes, sync: Optional["PhaseSync"] = None) -> None: ...

    def verify(self, batch: list[Request], rep: StepModes, sync: Optional["PhaseSync"] = None) -> None: ...


def coordinated_step(engine: CoordinatedEngine, rep: StepModes) -> None:
    """One iteration of a DP group under coordination: gather the modes, then run the passes of this group's mode."""
    running = engine.sched.running
    fresh = [r for r in running if not r.has_kv]
    decode = [r for r in running if r.proposal is not None]
    mode = ForwardMode.EXTEND if fresh else ForwardMode.TARGET_VERIFY if decode else ForwardMode.IDLE
    tokens = sum(engine.prefill_len(r) for r in fresh) if fresh else len(decode) * engine.T
    it = DpIteration(mode, gather_mlp_sync_info(engine.ctx, tokens, tokens, mode, engine.device), engine.ctx.attn_dp_rank)
    rep.dp_forward_modes = [m.name for m in it.sync.forward_modes]
    sync = PhaseSync.of(it)
    if sum(sync.dp_tokens) == 0:
        return  # every group idle: no pass, no collective
    if it.runs_prefill():
        engine.prefill(fresh, rep, sync)
    else:
        engine.verify(decode, rep, sync)
