"""The overlap scheduler of the speculative loop: iteration k is launched before the host reads iteration k-1's results.

SGLang's spec v2 overlap (managers/overlap_utils.py FutureMap, the scheduler's event_loop_overlap and run_batch; 0.5.4
is the release that reads most plainly) builds batch k while the device still runs k-1, so what k-1 decides (the
tokens it accepts, the draft's next proposal, the new sequence lengths) is not on the host when k is built:

- the batch carries placeholders: every token of a lane whose inputs k-1 makes is -slot, slot the FutureMap index
  k-1 stored that request's outputs at (allocated at k-1's launch: ct + 1 .. ct + bs of a ring of future_limit =
  3 * max_running_requests, so slot 0, and a placeholder -0, never exist); its positions come from the slot too;
- at launch they are resolved on the device (resolve_future: where(ids < 0, buf[-ids], ids)), the passes run, and the
  iteration's outputs are stored at k's own slots (store_to_map): the next verify's lane [bonus, d_1..d_S], the new
  sequence length, the accept length and the verified rows the host will commit from;
- the host processes k-1 after launching k: it reads k-1's slots, commits, finishes requests and frees pages. So a
  slot lives across two iterations (written by k-1, read by k's launch and by k-1's processing, after k stored its
  own): a ring that handed k any of k-1's slots would have k's results overwrite k-1's before the host reads them.

What k needs on the host is what the host knows (k-2 processed): the batch's requests and their KV reservation, which
covers any accept length of k-1 (a request's pages reach 2 * num_draft_tokens - 1 positions past its known length,
trimmed once k-1 is processed). A request that k-1 finished still runs in k; its results are dropped. The sequence
lengths are read back for the host mirrors the graph runners keep (SGLang 0.5.4 synchronizes seq_lens the same way);
the tokens never are.

The device accepts a chain (topk 1): accept_len = 1 + the leading drafts equal to the target's argmax, the verified
rows in lane order; so the multi-layer draft only (SpecConfig.overlap_schedule). A prefill is not overlapped: its
first token and proposal are read at once and its requests join the next launch with explicit tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from runners.batch import EagleVerifyInput, ForwardBatch, ForwardMode
from runners.decode_cuda_graph_runner import DecodeCudaGraphRunner, VerifyInputs
from runners.dp_metadata import gathered_metadata
from runners.draft_decode import EagleProposer
from runners.draft_extend import DraftExtendInputs
from runners.parallel.dp_attention import RankContext, mlp_sync_batch_sizes
from runners.scheduler import KVBook, Request, Scheduler
from runners.target import TargetOutput, TargetRunner
from runners.verify import chain_mask


@dataclass(frozen=True)
class FutureIndices:
    indices: torch.Tensor  # [bs] the slots of one launch, on the device
    interval: slice


class FutureMap:
    """The ring of future slots of one rank: what an iteration leaves for the next launch and for its own processing."""

    def __init__(self, max_running_requests: int, T: int, device: torch.device):
        self.future_ct = 0
        self.future_limit = max_running_requests * 3  # a launch's slots never meet the previous launch's (bs <= max_running)
        n = max_running_requests * 5  # the highest slot: future_limit - 1 + bs
        i64 = dict(dtype=torch.int64, device=device)
        self.lane_tokens = torch.zeros(n, T, **i64)  # the next verify's lane: the bonus token, then the draft's chain
        self.new_seq_lens = torch.zeros(n, **i64)  # committed tokens after the round (the bonus's position + 1)
        self.accept_lens = torch.zeros(n, **i64)
        self.verified = torch.zeros(n, T, **i64)  # the target's argmax after each lane node: the first accept_len are committed

    def alloc_future_indices(self, bs: int) -> FutureIndices:
        start = self.future_ct + 1
        self.future_ct = (self.future_ct + bs) % self.future_limit
        return FutureIndices(torch.arange(start, start + bs, device=self.lane_tokens.device), slice(start, start + bs))

    def resolve_future(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[bs * T] lane tokens, -slot for a token the launch before made: that slot's lane token of the same column."""
        T = self.lane_tokens.shape[1]
        col = torch.arange(input_ids.shape[0], device=input_ids.device) % T
        return torch.where(input_ids < 0, self.lane_tokens[(-input_ids).clamp(min=0), col], input_ids)

    def resolve_seq_lens(self, future: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
        """[bs] committed tokens before the round: the slot's (future > 0), else the host's."""
        return torch.where(future > 0, self.new_seq_lens[future], known)

    def store_to_map(self, fi: FutureIndices, lane_tokens: torch.Tensor, new_seq_lens: torch.Tensor, accept_lens: torch.Tensor,
                     verified: torch.Tensor) -> None:
        self.lane_tokens[fi.interval] = lane_tokens
        self.new_seq_lens[fi.interval] = new_seq_lens
        self.accept_lens[fi.interval] = accept_lens
        self.verified[fi.interval] = verified


@dataclass
class LaunchedBatch:
    """A launched iteration until the host processes it (SGLang keeps it in batch_record_buf for the two iterations)."""

    reqs: list[Request]
    preemptions: list[int]  # each request's preemption count at launch: a later incarnation is not this lane's
    future: FutureIndices


def chain_accept(lane_ids: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """[bs] accept lengths of chain lanes on the device: 1 + the leading drafts that equal the argmax before them."""
    match = (lane_ids[:, 1:] == argmax[:, :-1]).to(torch.int64)
    return 1 + match.cumprod(dim=1).sum(dim=1)


def verify_forward_batch(ctx: RankContext, inp: VerifyInputs, T: int, dp_tokens: list[int]) -> ForwardBatch:
    """The eager TARGET_VERIFY batch of device-resolved chain lanes (runners.target.extend_batch builds one from host lanes)."""
    bs, dev = inp.bs, inp.input_ids.device
    i64 = dict(dtype=torch.int64, device=dev)
    meta = gathered_metadata(ctx.layout, dp_tokens, dp_tokens, ctx.attn_dp_rank)
    return ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=inp.input_ids, positions=inp.positions, seq_lens=inp.seq_lens,
        req_pool_indices=inp.req_pool_indices, out_cache_loc=torch.empty(bs * T, **i64), extend_seq_lens=torch.full((bs,), T, **i64),
        extend_start_loc=torch.arange(bs, **i64) * T, spec_info=EagleVerifyInput(T, chain_mask(T).to(dev).expand(bs, T, T)),
        extend_seq_lens_cpu=[T] * bs, extend_num_tokens=bs * T, num_token_non_padded=bs * T,
        seq_lens_sum=int(inp.seq_lens_cpu.sum()), seq_lens_cpu=inp.seq_lens_cpu, **meta.forward_batch_fields(dev),
    )


class OverlapEngine(Protocol):
    """What the overlap scheduler needs of the engine (runners.spec_decode.SpecEngine)."""

    ctx: RankContext
    device: torch.device
    T: int
    sched: Scheduler
    book: KVBook
    target: TargetRunner
    draft: EagleProposer
    verify_graph: Optional[DecodeCudaGraphRunner]


@dataclass
class OverlapRound:
    """What processing one request's lane of a launched iteration committed (the engine reports it)."""

    req: Request
    accept_len: int
    committed: int
    finished: bool


@dataclass
class OverlapScheduler:
    engine: OverlapEngine
    future_map: FutureMap
    pending: Optional[LaunchedBatch] = None  # the launch the host has not processed yet

    @classmethod
    def of(cls, engine: OverlapEngine, max_running_requests: int) -> "OverlapScheduler":
        return cls(engine, FutureMap(max_running_requests, engine.T, engine.device))

    def launch(self) -> Optional[tuple[LaunchedBatch, list]]:
        """Build iteration k from what the host knows, resolve its placeholders, run verify and draft-extend, store the
        outputs at k's slots. Returns the launch and the draft-extend's step outputs (None: every DP group idle)."""
        e, T, dev = self.engine, self.engine.T, self.engine.device
        pending = {id(r): i for i, r in enumerate(self.pending.reqs)} if self.pending is not None else {}
        reqs = [r for r in e.sched.running if r.has_kv and (r.proposal is not None or id(r) in pending)]
        ids, known, future = [], [], []
        for r in reqs:
            if r.proposal is not None:  # its inputs are the host's: a request prefilled this step
                ids += [r.tokens[-1], *r.proposal.tokens]
                known.append(len(r.tokens))
                future.append(0)
                e.book.ensure(r, len(r.tokens) - 1 + T)
                r.proposal = None  # its next proposal will be in the future map
            else:  # the launch before made its inputs: placeholders, and pages for any accept length of that launch
                slot = int(self.pending.future.indices[pending[id(r)]])
                ids += [-slot] * T
                known.append(0)
                future.append(slot)
                e.book.ensure(r, self.reserved_positions(r))
        dp_sizes = mlp_sync_batch_sizes(e.ctx, len(reqs), dev)
        if sum(dp_sizes) == 0:
            return None
        fi = self.future_map.alloc_future_indices(len(reqs))
        i64 = dict(dtype=torch.int64, device=dev)
        lane_ids = self.future_map.resolve_future(torch.tensor(ids, **i64)).view(-1, T)
        n = self.future_map.resolve_seq_lens(torch.tensor(future, **i64), torch.tensor(known, **i64))  # committed tokens
        root = n - 1
        positions = (root[:, None] + torch.arange(T, **i64)[None, :]).reshape(-1)
        seq_lens = root + T
        pool = torch.tensor([r.req_pool_idx for r in reqs], **i64)
        out = self._verify(VerifyInputs(lane_ids.reshape(-1), positions, seq_lens, pool, dp_sizes, seq_lens_cpu=seq_lens.cpu()))
        argmax = out.logits.argmax(dim=-1).view(-1, T)
        accept_lens = chain_accept(lane_ids, argmax)
        bonus = argmax.gather(1, (accept_lens - 1)[:, None])
        outs = e.draft.run_extend(DraftExtendInputs(argmax.reshape(-1), positions, seq_lens, pool, out.hidden.clone(), accept_lens, dp_sizes))
        chain = torch.stack([o.topk_index[:, 0] for o in outs], dim=1).to(torch.int64)
        self.future_map.store_to_map(fi, torch.cat([bonus, chain], dim=1), n + accept_lens, accept_lens, argmax)
        return LaunchedBatch(reqs, [r.preemptions for r in reqs], fi), outs

    def reserved_positions(self, r: Request) -> int:
        """Positions a request whose last launch is unread needs for the next: that launch accepted up to T tokens past
        the n the host knows, so this one verifies at most up to n + 2T - 2."""
        return len(r.tokens) + 2 * self.engine.T - 1

    def kept_positions(self, r: Request) -> int:
        """Once a launch is read: the positions the launch after it verified (from the new last token on), whose
        accepted KV the request keeps; the pages past them are free."""
        return len(r.tokens) - 1 + self.engine.T

    def _verify(self, inp: VerifyInputs) -> TargetOutput:
        """The TARGET_VERIFY graph when one fits, else the eager pass (as the engine's verify)."""
        e = self.engine
        g = e.verify_graph
        if g is not None:
            if g.can_run(inp):
                return g.replay(inp)
            g.backend.stats.eager_fallbacks += 1
        dp_tokens = [b * e.T for b in inp.dp_batch_sizes]
        return e.target.run_batch(verify_forward_batch(e.ctx, inp, e.T, dp_tokens), dp_tokens)

    def process(self, launched: LaunchedBatch) -> list[OverlapRound]:
        """The host reads a launched iteration's slots (after the next launch stored its own) and commits."""
        e, fm = self.engine, self.future_map
        idx = launched.future.indices
        accept_lens, verified = fm.accept_lens[idx].tolist(), fm.verified[idx].tolist()
        rounds = []
        for r, incarnation, a, rows in zip(launched.reqs, launched.preemptions, accept_lens, verified, strict=True):
            if r.status != "running" or r.preemptions != incarnation:
                continue  # finished or preempted since the launch: its lane's results are dropped
            take = min(a, r.remaining)
            r.tokens.extend(rows[:take])
            r.accept_lens.append(a)
            r.sibling_accepts.append(False)
            done = r.remaining <= 0
            if done:
                e.sched.finish(r.rid)
            else:
                e.book.truncate(r, self.kept_positions(r))
            rounds.append(OverlapRound(r, a, take, done))
        return rounds
