"""Draft proposers: the multi-layer EAGLE draft (eager or graph draft-extend) and an agreeing draft.

Multi-layer EAGLE (MTP): draft step k runs draft layer k (docs/spec-decode.md), so the draft's
decode steps *are* the steps of its draft-extend pass: after each verify, draft-extend runs
the S layers over every request's T = S + 1 verified tokens (DRAFT_EXTEND_V2), and step k's
top-k at the request's selected row (its last accepted token) is the proposal for depth
k + 1; the next step is fed the top-1 (`draft_extend_step`). The same body runs eagerly
(`run_eager`) or through the graph runners (`DraftExtendGraphDriver`).

Row pairing (EAGLE): draft row j reads token j + 1 with the target's hidden state of
token j, at token j's position. After a verify of [x, d_1..d_S] the rows' tokens are the
target's argmax g_0..g_S (row a - 1 holds the bonus; rows past it are rejected junk that
the next round overwrites) and the hidden states are the verify's rows.

Prefill (new or resumed requests) runs the same step body eagerly over the prompt in
chunks of T rows, one chunk per DRAFT_EXTEND_V2 lane (seq_len = the chunk's end), each
chunk selecting its last row; only the last chunk's selection (the prompt's last row) is
a proposal. A last partial chunk selects its last real row; its junk rows sit at the first
verify's positions and are overwritten by the first draft-extend.

Single-layer EAGLE (`draft="single_layer"`): one draft layer; the draft-extend (the same body,
eager or EAGLEDraftExtendCudaGraphRunner) gives depth 1's top-k and the selected row's hidden
state, then the draft decode (runners.eagle_draft, eager or EAGLEDraftCudaGraphRunner) runs the
layer num_steps - 1 more times over topk lanes per request and expands the tree; the proposal
is the tree's best path with its parents' other children as siblings.

`TargetProposer` is the agreeing draft of P5: it shares the target's weights and proposes
by S one-token decode steps of the target itself, so every proposal is the target's argmax
and a correct loop accepts every token.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from runners.attention import make_backend
from runners.config import DraftKind, ModelConfig, SpecConfig
from runners.draft_extend import (
    DraftExtendInputs,
    DraftWorker,
    StepOutputs,
    draft_extend_step,
    eager_forward_batch,
    without_logprob,
)
from runners.draft_extend_graph_driver import DraftExtendGraphDriver, run_draft_extend_eager
from runners.draft_parallel import draft_rank_context, handoff_proposals, has_idle_ranks
from runners.eagle_draft import (
    DraftDecodeInputs,
    DraftDecodeOutputs,
    check_draft_window,
    require_draft_decode,
    run_eager_decode,
    tree_proposals,
)
from runners.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
from runners.graph.backend import GraphBackend
from runners.graph.mode import GraphMode
from runners.llama_eagle3 import draft_to_target
from runners.memory import ReqToTokenPool
from runners.parallel.dp_attention import RankContext, mlp_sync_batch_sizes
from runners.scheduler import Proposal, Request
from runners.target import Lane, TargetRunner

DRAFTS = tuple(DraftKind)  # the values a case file names (a DraftKind is its value)


def eagle_pairs(tokens_after: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE's row pairing, for prefill and draft-extend alike: row j reads the token after
    position j (tokens_after[j]) with the target's hidden state at position j (hidden[j])."""
    return tokens_after, hidden


def proposals_from_steps(outs: Sequence[StepOutputs], lanes: Sequence[int]) -> list[Proposal]:
    """Each step's top-k at the given lanes' selected rows: one proposal per lane."""
    per_step = [o.topk_index[list(lanes)].tolist() for o in outs]  # [S][n][k]
    return [Proposal([int(s[i][0]) for s in per_step], [[int(t) for t in s[i]] for s in per_step]) for i in range(len(lanes))]


class EagleProposer:
    """The EAGLE draft of one rank (multi-layer, or single-layer / EAGLE3 with its draft decode): a DraftWorker on the
    engine's request map, in the draft's own layout (runners.draft_parallel). A rank that holds no draft (draft_tp_size
    below the attention-TP size) has no worker and receives its group's proposals (`handoff_proposals`)."""

    def __init__(self, ctx: RankContext, cfg: ModelConfig, spec: SpecConfig, req_pool: ReqToTokenPool, num_slots: int,
                 runner: GraphMode | str, device: torch.device, attention_backend: str = "torch", graph_kind: str = "auto",
                 draft: DraftKind | str = DraftKind.MULTI_LAYER):
        if runner not in set(GraphMode):
            raise ValueError(f"runner must be one of {', '.join(GraphMode)}, got {runner!r}")
        if draft not in DRAFTS:
            raise ValueError(f"draft must be one of {DRAFTS}, got {draft!r}")
        self.single_layer = DraftKind(draft).has_draft_decode
        if self.single_layer:
            check_draft_window(spec.num_steps, spec.topk, spec.num_tokens_per_bs)
        self.ctx, self.spec, self.device, self.runner = ctx, spec, device, runner
        self.handoff = has_idle_ranks(ctx.layout, spec)  # some rank of the group has no draft: proposals are broadcast
        self.driver: Optional[DraftExtendGraphDriver] = None
        self.decode_graph: Optional[EAGLEDraftCudaGraphRunner] = None
        self.last_outs: list[StepOutputs] = []
        self.last_decode: Optional[DraftDecodeOutputs] = None
        self.worker: Optional[DraftWorker] = None
        dctx = draft_rank_context(ctx, spec)
        if dctx is None:
            return
        w = DraftWorker(dctx, cfg, spec, num_layers=1 if self.single_layer else None, attention_backend=attention_backend, device=device,
                        max_reqs=req_pool.req_to_token.shape[0], num_slots=num_slots)
        # one request map per rank, written by the scheduler, read by target and draft (as in the engine)
        w.req_pool = req_pool
        w.attn = make_backend(attention_backend, req_pool=req_pool, kv_pool=w.kv_pool)
        if self.single_layer and spec.num_steps > 1:
            require_draft_decode(w.attn)  # the draft decode attends with the case's backend, eager and graph alike
        self.worker = w

    @property
    def model(self):
        return None if self.worker is None else self.worker.model

    def capture(self, graphs: Optional[GraphBackend]) -> None:
        """Build and capture the graph runners (after any weight change: a graph bakes nothing else) into the pool of
        `graphs`, the rank's backend (GraphBackend.sibling); None when the runner is eager."""
        if self.runner == "graph" and self.worker is not None:
            self.driver = DraftExtendGraphDriver(self.worker, graphs.sibling(), single_layer=self.single_layer)
            self.driver.capture()
            if self.single_layer and self.spec.num_steps > 1:
                self.decode_graph = EAGLEDraftCudaGraphRunner(self.worker, graphs.sibling())
                self.decode_graph.capture()

    def _handed_off(self, props: Optional[list[Proposal]], num_requests: int) -> list[Proposal]:
        """The group's proposals on every rank of it (the draft's own where no rank is without one)."""
        if not self.handoff:
            return props
        return handoff_proposals(self.ctx, props, num_requests, self.spec.num_steps, self.spec.topk, self.device)

    # ---- prefill: the prompt, in T-row chunks, eagerly ----
    def prefill(self, reqs: Sequence[Request], hiddens: Sequence[torch.Tensor]) -> list[Proposal]:
        props = self._prefill(reqs, hiddens) if self.worker is not None else None
        return self._handed_off(props, len(reqs))

    def _prefill(self, reqs: Sequence[Request], hiddens: Sequence[torch.Tensor]) -> list[Proposal]:
        w, T, dev = self.worker, self.worker.tokens_per_bs, self.device
        H = w.input_hidden_size
        ids, pos, seq, pool, acc, hid, finals, rows_of = [], [], [], [], [], [], [], []
        for r, h in zip(reqs, hiddens, strict=True):
            L = h.shape[0]  # rows 0..L-1 of the prompt
            chunks = -(-L // T)
            tok, h = eagle_pairs(torch.tensor(r.tokens[1 : L + 1], dtype=torch.int64), h)
            ids.append(tok.tolist() + [0] * (chunks * T - L))
            hid.append(torch.cat([h.to(w.cfg.torch_dtype), h.new_zeros(chunks * T - L, H)]))
            for c in range(chunks):
                pos.extend(range(c * T, c * T + T))
                seq.append(c * T + T)
                pool.append(r.req_pool_idx)
                acc.append(min(T, L - c * T))
            rows_of.append(L)
            finals.append(len(seq) - 1)
        dp_sizes = mlp_sync_batch_sizes(w.ctx, len(seq), dev)
        if sum(dp_sizes) == 0:
            return []
        i64 = dict(dtype=torch.int64, device=dev)
        flat = [t for x in ids for t in x]
        inp = DraftExtendInputs(
            input_ids=torch.tensor(flat, **i64), positions=torch.tensor(pos, **i64), seq_lens=torch.tensor(seq, **i64),
            req_pool_indices=torch.tensor(pool, **i64),
            hidden_states=torch.cat(hid) if hid else torch.zeros(0, H, dtype=w.cfg.torch_dtype, device=dev),
            accept_lens=torch.tensor(acc, **i64), dp_batch_sizes=dp_sizes,
        )
        seqs = [list(x) for x in ids]  # per request, the row tokens of the current layer
        input_ids, hidden, outs = inp.input_ids, inp.hidden_states, []
        for step in range(w.num_layers):
            out = draft_extend_step(w, step, eager_forward_batch(w, inp, input_ids, hidden))
            outs.append(out)
            top1 = out.topk_index[finals, 0].tolist() if finals else []
            for s, L, t in zip(seqs, rows_of, top1, strict=True):  # shift by one; this step's proposal at the last real row
                s[: L - 1] = s[1:L]
                s[L - 1] = int(t)
            input_ids = torch.tensor([t for s in seqs for t in s], **i64)
            hidden = out.hidden
        if self.single_layer:
            rows = [f * T + acc[f] - 1 for f in finals]
            return self._decode(outs[0], finals, rows, inp.positions, [r.req_pool_idx for r in reqs])
        return proposals_from_steps(outs, finals)

    # ---- draft-extend after a verify ----
    def run_extend(self, inp: DraftExtendInputs, graphs: bool = True) -> list[StepOutputs]:
        """The draft-extend's step outputs, on the device. graphs=False: eagerly, whatever the buckets (a DP-coordinated
        step where a group extends, runners.mixed_modes)."""
        inp = without_logprob(inp)  # the verify's batch carries the flag in; no draft pass runs with it
        outs = self.driver.run(inp) if self.driver is not None and graphs else run_draft_extend_eager(self.worker, inp)[0]
        self.last_outs = outs
        return outs

    def extend(self, inp: Optional[DraftExtendInputs], num_requests: int, graphs: bool = True) -> list[Proposal]:
        """`inp` None: this rank holds no draft, or every DP group is idle (then no rank calls it)."""
        props = None
        if self.worker is not None:
            outs = self.run_extend(inp, graphs)
            if self.single_layer:
                rows = (torch.arange(inp.bs, device=self.device) * self.worker.tokens_per_bs + inp.accept_lens - 1).tolist()
                props = self._decode(outs[0], list(range(inp.bs)), rows, inp.positions, inp.req_pool_indices.tolist())
            else:
                props = proposals_from_steps(outs, range(inp.bs))
        return self._handed_off(props, num_requests)

    # ---- single-layer: the draft decode after the draft-extend ----
    def _decode(self, out: StepOutputs, lanes: list[int], rows: list[int], positions: torch.Tensor, pool: list[int]) -> list[Proposal]:
        """The selected row of each request (it read the last committed token at position p) seeds lanes at position p + 1.
        The draft-extend's top-k are draft ids (an EAGLE3 draft's): the draft decode maps them where it embeds them,
        and the proposal's first depth here."""
        self.last_decode = None
        S, k, dev = self.spec.num_steps, self.spec.topk, self.device
        first = draft_to_target(self.worker.hot_token_id, out.topk_index[lanes])
        if S == 1:
            return tree_proposals(first, None, S)
        dp_sizes = mlp_sync_batch_sizes(self.worker.ctx, len(lanes), dev)
        seq = positions[rows] + 1
        inp = DraftDecodeInputs(out.topk_p[lanes], out.topk_index[lanes], out.hidden[rows], seq,
                                torch.tensor(pool, dtype=torch.int64, device=dev), seq.repeat_interleave(k), dp_sizes)
        g = self.decode_graph
        if g is not None and g.can_run(inp):
            dout = g.replay(inp)
        else:
            if g is not None:
                g.backend.stats.eager_fallbacks += 1
            dout = run_eager_decode(self.worker, inp)
        self.last_decode = dout
        return tree_proposals(first, dout, S)


class TargetProposer:
    """The agreeing draft: the target's own weights, S one-token greedy decode steps with top-k."""

    def __init__(self, target: TargetRunner, spec: SpecConfig):
        self.target, self.spec = target, spec
        self.model = None  # no draft model of its own

    def capture(self, graphs: Optional[GraphBackend]) -> None:
        pass  # no graphs: the target's own decode steps run eagerly

    def prefill(self, reqs: Sequence[Request], hiddens: Sequence[torch.Tensor]) -> list[Proposal]:
        return self.propose(reqs)

    def propose(self, reqs: Sequence[Request]) -> list[Proposal]:
        """Decode steps at positions n-1 .. n-2+S (the next verify's, whose pass rewrites their KV)."""
        k, cur = self.spec.topk, [r.tokens[-1] for r in reqs]
        cands: list[list[list[int]]] = [[] for _ in reqs]
        for step in range(self.spec.num_steps):
            lanes = [Lane(r.req_pool_idx, len(r.tokens) - 1 + step, [t]) for r, t in zip(reqs, cur, strict=True)]
            out = self.target.forward(lanes)
            if out is None:
                break
            top = out.logits.float().topk(k, dim=-1).indices.tolist()
            for c, t in zip(cands, top, strict=True):
                c.append([int(x) for x in t])
            cur = [t[0] for t in top]
        return [Proposal([d[0] for d in c], c) for c in cands]
