"""The speculative decoding loop of one rank: prefill, verify, draft-extend, KV bookkeeping.

SPMD: every rank of a layout runs the same `SpecEngine.step()`; a rank serves the requests
of its DP attention group (`Request.dp_rank`) and ignores the others' commands. Each step:

1. prefill every running request without KV (new, or resumed after a preemption): one
   target EXTEND over their tokens but the last, then the draft's prefill -> proposals;
2. verify every request with a proposal: one target pass over its tree of T = num_tokens_per_bs
   nodes (the last token and T - 1 drafts: the chain, and with topk > 1 the top-k siblings;
   runners.verify), greedy acceptance along the tree, the accepted nodes' KV moved to their
   chain positions, commit (never past max_new_tokens), finish the requests that are done.
   With runner="graph" the verify replays the TARGET_VERIFY graph (runners.decode_cuda_graph_runner); a
   batch no bucket fits runs the eager pass (the same step body);
3. draft-extend over the verified tokens (eager or graph runner) -> the next proposals;
   free the rejected positions' slots; allocate the next verify's.

Two other schedules of a step: under DP coordination (SpecConfig.dp_spec_prefill_coordination) each
DP group runs the passes of its own mode, the modes gathered first (runners.mixed_modes); under the
overlap scheduler (SpecConfig.overlap_schedule) a step prefills, launches the verify and draft-extend
of every running request, then processes the launch before it (runners.overlap). A request may ask
for logprobs: the verify's accepted rows give them (runners.logprobs).

Weights are random, so a plain random draft would accept nothing and P6 would measure
nothing. `Alignment` makes acceptance informative and layout-independent: it shrinks the
target's residual branches (the target's next token then depends mostly, not only, on the
current one) and tilts the draft's fc toward the token embedding, keeping a scaled random
hidden half; the same adjustment on every rank, runner and layout.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from runners import draft_decode
from runners.config import DraftKind, ModelConfig, SpecConfig, draft_input_hidden_size
from runners.decode_cuda_graph_runner import DecodeCudaGraphRunner, verify_inputs
from runners.draft_decode import EagleProposer, TargetProposer
from runners.draft_extend import DraftExtendInputs, StepOutputs
from runners.draft_parallel import check_draft_config
from runners.eagle_draft import DraftDecodeOutputs
from runners.graph.backend import GraphBackend
from runners.llama_eagle3 import Eagle3DraftModel
from runners.logprobs import LogprobParams, add_logprob_return_values, compute_spec_logprobs
from runners.memory import ReqToTokenPool
from runners.mixed_modes import PhaseSync, coordinated_step
from runners.model import DraftModel, TargetModel
from runners.overlap import OverlapScheduler
from runners.parallel.dp_attention import RankContext, mlp_sync_batch_sizes
from runners.parallel.layout import DpPaddingMode
from runners.scheduler import KVBook, Request, Scheduler
from runners.target import Lane, TargetOutput, TargetRunner
from runners.verify import DraftTree, accept, kv_moves, tree_of


@dataclass(frozen=True)
class Alignment:
    target_branch: float = 0.05  # scale of every target layer's o_proj and MLP down projection
    draft_branch: float = 0.1  # the same for every draft layer
    draft_embed: float = 1.0  # fc's token-embedding half := draft_embed * I
    draft_hidden: float = 0.2  # fc's hidden-state half: the seeded weights times this

    def apply_target(self, model: TargetModel) -> None:
        for layer in model.layers:
            layer.wo.mul_(self.target_branch)
            layer.w_down.mul_(self.target_branch)

    def apply_draft(self, model: DraftModel | Eagle3DraftModel) -> None:
        if isinstance(model, Eagle3DraftModel):  # its own structure: the token reaches it through attention only
            model.align_to_target(self.draft_embed, self.draft_hidden, self.draft_branch)
            return
        H = model.cfg.hidden_size
        for dl in model.layers:
            dl.fc[:, :H] = self.draft_embed * torch.eye(H, dtype=dl.fc.dtype)
            dl.fc[:, H:].mul_(self.draft_hidden)
            dl.layer.wo.mul_(self.draft_branch)
            dl.layer.w_down.mul_(self.draft_branch)

    def to_json(self) -> dict:
        return asdict(self)


DEFAULT_ALIGNMENT = Alignment()


def slot_budget(spec: SpecConfig, max_context_len: int) -> int:
    """Tight on purpose (freed pages come back soon): every running request at full context in whole
    pages (a tree's nodes sit in the request's own slots), the padding page."""
    pages = -(-max_context_len // spec.page_size)
    return spec.page_size * (1 + spec.max_running_requests * pages)


@dataclass
class RoundResult:
    """What one verify round did to one request."""

    rid: int
    accept_len: int
    sibling: bool
    committed: int


@dataclass
class StepReport:
    step: int
    prefilled: list[int] = field(default_factory=list)
    verified: list[RoundResult] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    extend_rids: list[int] = field(default_factory=list)  # row order of the draft-extend below
    extend_outs: list[StepOutputs] = field(default_factory=list)  # per draft step, real rows (copies: runners.outputs)
    decode_outs: Optional[DraftDecodeOutputs] = None  # the single-layer draft decode's tree (real requests)
    dp_forward_modes: list[str] = field(default_factory=list)  # under DP coordination: every DP group's mode this step


def loop_unsupported_reason(spec: SpecConfig) -> Optional[str]:
    """Why the speculative decoding loop cannot run this config (None: it can)."""
    T, S, k = spec.num_tokens_per_bs, spec.num_steps, spec.topk
    if k == 1 and T != S + 1:
        return f"with topk 1 the draft proposes a chain of num_steps drafts, so num_tokens_per_bs must be {S + 1}, got {T}"
    if not 2 <= T <= 1 + S * k:
        return f"the verify tree has the root and at most num_steps * topk = {S * k} drafts, so num_tokens_per_bs must be in [2, {1 + S * k}], got {T}"
    if spec.draft.has_draft_decode and k * (S - 1) > T:
        return f"the {spec.draft.value} draft decode writes topk * (num_steps - 1) = {k * (S - 1)} slots past the prefix, more than num_tokens_per_bs ({T})"
    return None


class SpecEngine:
    def __init__(self, ctx: RankContext, cfg: ModelConfig, spec: SpecConfig, proposer: str = "eagle", runner: str = "eager",
                 tree: Optional[bool] = None, device: str | torch.device = "cpu", alignment: Alignment = DEFAULT_ALIGNMENT,
                 attention_backend: str = "torch", num_slots: Optional[int] = None):
        T, S = spec.num_tokens_per_bs, spec.num_steps
        if (why := loop_unsupported_reason(spec)) is not None:
            raise ValueError(why)
        check_draft_config(cfg, ctx.layout, spec)
        self.ctx, self.cfg, self.spec, self.device = ctx, cfg, spec, torch.device(device)
        self.T, self.S = T, S
        self.tree = spec.topk > 1 if tree is None else tree
        if not self.tree and T != S + 1:
            raise ValueError(f"without the tree the draft's chain fills {S + 1} verify tokens, not num_tokens_per_bs {T}")
        spec.check_layout(ctx.layout)
        self.alignment = alignment
        num_slots = num_slots or slot_budget(spec, cfg.max_context_len)
        max_reqs = 1 + spec.max_running_requests  # the padding row and one row per request
        self.req_pool = ReqToTokenPool(max_reqs, cfg.max_context_len, self.device, spec.padding_convention)
        self.target = TargetRunner(ctx, cfg, self.req_pool, num_slots, self.device, attention_backend, spec.page_size)
        self.book = KVBook(self.req_pool, num_slots, spec.page_size)  # one slot index space for the target's and the draft's pools
        self.sched = Scheduler(self.book, spec.max_running_requests)
        alignment.apply_target(self.target.model)
        if spec.draft is DraftKind.EAGLE3:  # the target hands the draft these layers' residual streams (SGLang's model runner)
            self.target.model.set_eagle3_layers_to_capture(spec.eagle_aux_hidden_state_layer_ids)
        if proposer == "eagle":
            self.draft = EagleProposer(ctx, cfg, spec, self.req_pool, num_slots, runner, self.device, attention_backend, draft=spec.draft)
            if self.draft.model is not None:
                alignment.apply_draft(self.draft.model)
        elif proposer == "target":
            self.draft = TargetProposer(self.target, spec)
        else:
            raise ValueError(f"proposer must be 'eagle' or 'target', got {proposer!r}")
        # one graph pool per rank, as SGLang's global graph pool: the target's graphs first (its model runner captures at
        # init), then the draft's; all after the alignment (a graph bakes the weights it was captured with)
        graphs = GraphBackend("auto", self.device) if runner == "graph" else None
        self.verify_graph: Optional[DecodeCudaGraphRunner] = None
        if graphs is not None:
            self.verify_graph = DecodeCudaGraphRunner(ctx, cfg, spec, self.target, graphs.sibling(), self.device)
            self.verify_graph.capture()
        self.draft.capture(graphs)
        self.overlap: Optional[OverlapScheduler] = None
        if spec.overlap_schedule:
            if not isinstance(self.draft, EagleProposer):
                raise ValueError("overlap_schedule runs the EAGLE draft's chain on the device: proposer 'eagle' only")
            self.overlap = OverlapScheduler.of(self, spec.max_running_requests)
        self.steps = 0

    # ---- commands (the harness sends every rank every command; a rank keeps its DP group's) ----
    def mine(self, dp_rank: int) -> bool:
        return dp_rank == self.ctx.attn_dp_rank

    def add(self, rid: int, prompt: tuple[int, ...], max_new_tokens: int, dp_rank: int = 0, return_logprob: bool = False,
            top_logprobs_num: int = 0) -> None:
        if len(prompt) + max_new_tokens + self.T > self.cfg.max_context_len + 1:
            raise ValueError(f"request {rid}: prompt {len(prompt)} + {max_new_tokens} new + {self.T} verify tokens exceed max_context_len")
        if self.spec.overlap_schedule and (return_logprob or len(prompt) + max_new_tokens + 2 * self.T > self.cfg.max_context_len + 1):
            raise ValueError(f"request {rid}: under overlap_schedule no logprobs, and a request's pages reach {2 * self.T} positions past "
                             f"prompt + max_new_tokens ({len(prompt)} + {max_new_tokens}), within max_context_len {self.cfg.max_context_len}")
        if not 0 <= top_logprobs_num <= self.cfg.vocab_size or (top_logprobs_num and not return_logprob):
            raise ValueError(f"request {rid}: top_logprobs_num {top_logprobs_num} needs return_logprob and at most vocab_size {self.cfg.vocab_size} tokens")
        if self.mine(dp_rank):
            self.sched.add(Request(rid, tuple(prompt), max_new_tokens, dp_rank, return_logprob=return_logprob,
                                   top_logprobs_num=top_logprobs_num))

    def _owns(self, rid: int) -> bool:
        return any(r.rid == rid for r in self.sched.running + self.sched.waiting)

    def finish(self, rid: int) -> None:
        if self._owns(rid):
            self.sched.finish(rid)

    def preempt(self, rid: int) -> None:
        if self._owns(rid):
            self.sched.preempt(rid)

    def resume(self, rid: int) -> None:
        if self._owns(rid):
            self.sched.resume(rid)

    def requests(self) -> dict[int, Request]:
        out = {r.rid: r for r in self.sched.running + self.sched.waiting}
        out.update(self.sched.finished)
        return out

    # ---- one scheduler step ----
    def step(self) -> StepReport:
        """Every group's new requests prefilled, then every group's running ones verified, each in passes of their own;
        under DP coordination one pass per group in the group's own mode (runners.mixed_modes); under the overlap
        scheduler the running ones' verify launched before the host reads the launch before it (runners.overlap)."""
        rep = StepReport(self.steps)
        if self.spec.dp_spec_prefill_coordination:
            coordinated_step(self, rep)
        elif self.overlap is not None:
            self.prefill([r for r in self.sched.running if not r.has_kv], rep)
            self._overlap_step(rep)
        else:
            self.prefill([r for r in self.sched.running if not r.has_kv], rep)
            self.verify([r for r in self.sched.running if r.proposal is not None], rep)
        self.steps += 1
        return rep

    def _overlap_step(self, rep: StepReport) -> None:
        """runners.overlap: launch this iteration, then process the one launched before it."""
        ov = self.overlap
        launched = ov.launch()
        before, ov.pending = ov.pending, None if launched is None else launched[0]
        if launched is not None:
            rep.extend_rids = [r.rid for r in launched[0].reqs]
            rep.extend_outs = [o.cloned() for o in launched[1]]  # a report outlives the next step's replays
        for rnd in [] if before is None else ov.process(before):
            rep.verified.append(RoundResult(rnd.req.rid, rnd.accept_len, False, rnd.committed))
            if rnd.finished:
                rep.finished.append(rnd.req.rid)

    @staticmethod
    def prefill_len(r: Request) -> int:
        """The tokens a prefill extends: the prompt and output so far, but the last token of a resumed request (known)."""
        return len(r.tokens) if r.num_generated == 0 else len(r.tokens) - 1

    def prefill(self, fresh: list[Request], rep: StepReport, sync: Optional[PhaseSync] = None) -> None:
        """The target's EXTEND over the requests without KV, then the draft's prefill. `sync`: the iteration's gathered
        counts and padding (a DP-coordinated step, runners.mixed_modes); None: this pass syncs its own."""
        lanes = []
        for r in fresh:
            self.book.admit(r)
            L = self.prefill_len(r)
            self.book.ensure(r, L + self.T)  # the prefix and the first verify's positions
            lanes.append(Lane(r.req_pool_idx, 0, r.tokens[:L]))
        out = self.target.forward(lanes) if sync is None else self.target.forward_synced(lanes, sync.dp_tokens, sync.padding)
        if out is None:
            return
        rows = out.lane_rows(lanes)
        sampled = [r.num_generated == 0 for r in fresh]  # a resumed request knows its next token already
        for r, sl, new in zip(fresh, rows, sampled, strict=True):
            if new:
                r.tokens.append(int(out.logits[sl.stop - 1].argmax()))
        params = LogprobParams.of(fresh)
        if params.return_logprob:  # the sampled token's logprobs, from the prefill's last row of each request
            dev = out.logits.device
            last = torch.tensor([[sl.stop - 1] for sl in rows], dtype=torch.int64, device=dev)
            ids = torch.tensor([[r.tokens[-1]] for r in fresh], dtype=torch.int64, device=dev)
            add_logprob_return_values(fresh, [int(new) for new in sampled], compute_spec_logprobs(out.logits, last, ids, params))
        props = self.draft.prefill(fresh, [out.hidden[sl] for sl in rows])
        for r, p in zip(fresh, props, strict=True):
            r.proposal = p
        rep.prefilled = [r.rid for r in fresh]
        for r in fresh:
            if r.remaining <= 0:  # max_new_tokens == 1: the prefill's token was the whole answer
                self.sched.finish(r.rid)
                rep.finished.append(r.rid)

    def verify(self, batch: list[Request], rep: StepReport, sync: Optional[PhaseSync] = None) -> None:
        """The target's verify of every request with a proposal, acceptance, the draft-extend. `sync` as in prefill."""
        T = self.T
        n0 = [len(r.tokens) for r in batch]
        trees: list[DraftTree] = [tree_of(r.proposal, T - 1, self.tree) for r in batch]
        lanes = [Lane(r.req_pool_idx, n - 1, *t.lane(r.tokens[-1])) for r, n, t in zip(batch, n0, trees, strict=True)]
        out = self._target_verify(lanes, sync)
        if out is None:
            return
        rows = out.lane_rows(lanes)
        argmax = out.logits.argmax(dim=-1)
        g = torch.stack([argmax[sl] for sl in rows]) if batch else torch.zeros(0, T, dtype=torch.int64)
        accs = accept([lane.tokens for lane in lanes], [lane.parents for lane in lanes], g, [t.top1 for t in trees])
        params = LogprobParams.of(batch)
        ids, hid, takes = [], [], []
        for i, (r, acc) in enumerate(zip(batch, accs, strict=True)):
            self._move_accepted_kv(r, n0[i] - 1, acc.path)
            # draft-extend row j: the accepted node at depth j (its argmax, its hidden state); rows past
            # the accept length are junk the next round overwrites (the rejected nodes, in lane order)
            order = acc.path + [j for j in range(T) if j not in acc.path]
            row_ids, row_hid = g[i][order].clone(), out.hidden[rows[i]][order].clone()
            take = min(acc.accept_len, r.remaining)
            takes.append(take)
            r.tokens.extend(acc.new_tokens[:take])
            r.accept_lens.append(acc.accept_len)
            r.sibling_accepts.append(acc.off_chain)
            rep.verified.append(RoundResult(r.rid, acc.accept_len, acc.off_chain, take))
            row_ids, row_hid = draft_decode.eagle_pairs(row_ids, row_hid)
            ids.append(row_ids)
            hid.append(row_hid)
        live = [i for i, r in enumerate(batch) if r.remaining > 0]
        for r in batch:
            if r.remaining <= 0:
                self.sched.finish(r.rid)
                rep.finished.append(r.rid)
        reqs = [batch[i] for i in live]
        for r in reqs:  # rejected positions hold nothing anyone needs; the next verify needs T positions (the draft decode writes there first)
            self.book.truncate(r, len(r.tokens) - 1)
            self.book.ensure(r, len(r.tokens) - 1 + T)
        props = None
        if isinstance(self.draft, EagleProposer) and self.draft.worker is None:  # no draft here: the group's first rank hands on
            props = self.draft.extend(None, len(reqs)) if reqs else None
        elif isinstance(self.draft, EagleProposer):
            inp = self._extend_inputs(self.draft.worker.ctx, reqs, [n0[i] for i in live], [ids[i] for i in live], [hid[i] for i in live],
                                      [accs[i].accept_len for i in live], params.return_logprob)
            if inp is not None:
                props = self.draft.extend(inp, len(reqs), graphs=sync is None or sync.graphs)
                rep.extend_rids = [r.rid for r in reqs]
                rep.extend_outs = [o.cloned() for o in self.draft.last_outs]  # a report outlives the next step's replays
                rep.decode_outs = None if self.draft.last_decode is None else self.draft.last_decode.cloned()
        if props is None:
            props = self.draft.propose(reqs) if isinstance(self.draft, TargetProposer) else []
        for r, p in zip(reqs, props, strict=True):
            r.proposal = p
        if params.return_logprob:
            self._add_logprobs(batch, out, [rows[i].start for i in range(len(batch))], accs, takes, params)

    def _add_logprobs(self, batch: list[Request], out: TargetOutput, lane_start: list[int], accs: list, takes: list[int],
                      params: LogprobParams) -> None:
        """The round's committed tokens' logprobs, read from the verify's logits at the accepted rows (runners.logprobs).
        After the draft passes, as the engine processes a batch's result after its whole forward: the verify's
        logits are still the verify's (a graph's output buffer no draft replay writes)."""
        A = min(self.S, self.T - 1) + 1  # max_accept: the top-1 chain's depth + the bonus
        index = [[lane_start[i] + node for node in acc.path] + [-1] * (A - len(acc.path)) for i, acc in enumerate(accs)]
        tokens = [acc.new_tokens + [-1] * (A - len(acc.new_tokens)) for acc in accs]
        dev = out.logits.device
        lp = compute_spec_logprobs(out.logits, torch.tensor(index, dtype=torch.int64, device=dev),
                                   torch.tensor(tokens, dtype=torch.int64, device=dev), params)
        add_logprob_return_values(batch, takes, lp)

    def _move_accepted_kv(self, r: Request, root_pos: int, path: list[int]) -> None:
        """Target KV of each accepted node from its node slot (root + index) to its chain slot (root +
        depth), every layer, as the engine moves it after a tree verify; the draft rewrites its own
        KV at these positions in draft-extend."""
        moves = kv_moves(path)
        if not moves:
            return
        src = torch.tensor([r.slots[root_pos + i] for i, _ in moves], device=self.device)
        dst = torch.tensor([r.slots[root_pos + d] for _, d in moves], device=self.device)
        kv = self.target.kv_pool
        for t in kv.k + kv.v:
            t[dst] = t[src]

    def _target_verify(self, lanes: list[Lane], sync: Optional[PhaseSync] = None) -> Optional[TargetOutput]:
        """The verify pass: the TARGET_VERIFY graph when there is one and the batch fits, else eager.

        One MLP sync decides for every rank alike (the MLP-TP-gather branch pads every DP
        group to the largest one's bucket) and sizes the eager pass's metadata; a DP-coordinated
        step hands in its own (`sync`), which may rule graphs out for every rank.
        """
        if sync is None:
            sync = PhaseSync(mlp_sync_batch_sizes(self.ctx, sum(len(lane.tokens) for lane in lanes), self.device), DpPaddingMode.MAX_LEN, True)
        dp_tokens = sync.dp_tokens
        if sum(dp_tokens) == 0:
            return None
        g = self.verify_graph if sync.graphs else None
        if g is not None:
            inp = verify_inputs(lanes, [t // self.T for t in dp_tokens], self.device, self.T)
            if g.can_run(inp):
                return g.replay(inp)
            g.backend.stats.eager_fallbacks += 1
        return self.target.forward_synced(lanes, dp_tokens, sync.padding)

    def _extend_inputs(self, draft_ctx: RankContext, reqs, n0, ids, hid, accept_lens, return_logprob: bool = False) -> Optional[DraftExtendInputs]:
        """The verified tokens of every request, T rows each, as DRAFT_EXTEND_V2 lanes; the MLP sync of the draft's layout
        (the target's, or the draft's own group, which syncs nothing)."""
        dp_sizes = mlp_sync_batch_sizes(draft_ctx, len(reqs), self.device)
        if sum(dp_sizes) == 0:
            return None
        T, dev, H = self.T, self.device, draft_input_hidden_size(self.cfg, self.spec)
        i64 = dict(dtype=torch.int64, device=dev)
        pos = [p for n in n0 for p in range(n - 1, n - 1 + T)]
        seq_lens = torch.tensor([n - 1 + T for n in n0], dtype=torch.int64)
        accept = torch.tensor(accept_lens, dtype=torch.int64)
        return DraftExtendInputs(
            input_ids=torch.cat(ids).to(dev) if ids else torch.zeros(0, **i64),
            positions=torch.tensor(pos, **i64),
            seq_lens=seq_lens.to(dev),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs], **i64),
            hidden_states=torch.cat(hid) if hid else torch.zeros(0, H, dtype=self.cfg.torch_dtype, device=dev),
            accept_lens=accept.to(dev),
            dp_batch_sizes=dp_sizes,
            seq_lens_cpu=seq_lens,
            return_logprob=return_logprob,
            accept_lens_cpu=accept,
        )
