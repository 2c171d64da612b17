"""What the two draft-extend graph runners share: the static input buffers and the runner around them (construction,
the step body, the replay of a filled bucket), under which each writes its own `get_forward_batch` and replay fill
(runners.multi_layer_eagle_draft_extend_cuda_graph_runner, runners.eagle_draft_extend_cuda_graph_runner;
their replay fills line by line: docs/replay-fill.md).

SGLang's two runners each subclass DecodeCudaGraphRunner and each declare a buffer set of their own
(MultiLayerEagleDraftExtendInputBuffers, EagleDraftExtendInputBuffers). Ours hold one layout, DraftExtendInputBuffers,
and share this base, so what each writes apart is its get_forward_batch and replay fill: the code invariant I6
compares between them.

Every draft step extends each request by the same num_tokens_per_bs tokens, so the multi-layer runner's steps can read
one buffer set (as the engine's MultiLayerEagleMultiStepDraftExtendCudaGraphRunner shares one across its per-step
runners): it is filled once per iteration, and only the chain inputs (token ids, hidden states) change between steps.
The single-layer runner owns a set of its own.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from runners.base_cuda_graph_runner import BaseCudaGraphRunner, compute_capture_bs, gathered_buffers
from runners.batch import ForwardBatch
from runners.draft_extend import SEQ_LEN_FILL_VALUE, DraftExtendInputs, DraftWorker, StepOutputs, draft_extend_step
from runners.graph.backend import GraphBackend
from runners.graph.host import host_mirror
from runners.memory import LanePadding


@dataclass
class DraftExtendInputBuffers:
    """One persistent buffer set, sized for the largest bucket; the graphs hold views of it."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor  # host mirror of seq_lens, what a host-planned backend plans the replay with
    req_pool_indices: torch.Tensor
    num_correct_drafts: torch.Tensor
    num_accept_tokens: torch.Tensor
    extend_seq_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    hidden_states: torch.Tensor
    next_token_logits_buffer: torch.Tensor
    global_num_tokens_gpu: Optional[torch.Tensor]
    global_num_tokens_for_logprob_gpu: Optional[torch.Tensor]

    @classmethod
    def allocate(cls, worker: DraftWorker) -> "DraftExtendInputBuffers":
        spec, cfg, dev = worker.spec, worker.cfg, worker.device
        max_bs = max(compute_capture_bs(worker.ctx.layout, spec.capture_bs, spec.max_running_requests))
        T = worker.tokens_per_bs
        n = max_bs * T
        i64 = dict(dtype=torch.int64, device=dev)
        # Output only; a metadata-only worker (no model) never runs the body, so skips its rows.
        logits_rows = n if worker.model is not None else 0
        gnt, gnt_lp = gathered_buffers(worker.ctx.layout, dev)
        return cls(
            input_ids=torch.zeros(n, **i64),
            positions=torch.zeros(n, **i64),
            out_cache_loc=torch.full((n,), worker.pad.slot, **i64),
            seq_lens=torch.full((max_bs,), SEQ_LEN_FILL_VALUE, **i64),
            seq_lens_cpu=host_mirror(torch.full((max_bs,), SEQ_LEN_FILL_VALUE, dtype=torch.int64)),
            req_pool_indices=torch.full((max_bs,), worker.pad.row, **i64),
            num_correct_drafts=torch.ones(max_bs, **i64),
            num_accept_tokens=torch.ones(max_bs, **i64),
            extend_seq_lens=torch.full((max_bs,), T, **i64),
            extend_start_loc=torch.arange(max_bs, **i64) * T,
            # the target's hidden states (EAGLE3: its captured layers, concatenated), and logits over the draft's vocabulary
            hidden_states=torch.zeros(n, worker.input_hidden_size, dtype=cfg.torch_dtype, device=dev),
            next_token_logits_buffer=torch.zeros(logits_rows, worker.vocab_size, dtype=torch.float32, device=dev),
            global_num_tokens_gpu=gnt,
            global_num_tokens_for_logprob_gpu=gnt_lp,
        )

    def reset_to_padding(self, pad: LanePadding) -> None:
        """Every token row and lane to what a padded one holds: token 0 at position 0, the convention's write slot and
        request row (runners.memory.lane_padding), the seq-len fill value (its host mirror too)."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.out_cache_loc.fill_(pad.slot)
        self.seq_lens.fill_(SEQ_LEN_FILL_VALUE)
        self.seq_lens_cpu.fill_(SEQ_LEN_FILL_VALUE)
        self.req_pool_indices.fill_(pad.row)


def _buffer(name: str) -> property:
    return property(lambda self: getattr(self.buffers, name), doc=f"the runner's view of buffers.{name}")


class DraftExtendCudaGraphRunner(BaseCudaGraphRunner):
    """What both draft-extend runner kinds share. `buffers=None` gives the runner a set of its own."""

    def __init__(self, worker: DraftWorker, step: int, backend: GraphBackend, buffers: Optional[DraftExtendInputBuffers] = None):
        self.worker, self.step, self.backend = worker, step, backend
        self.layout = worker.ctx.layout
        self.T = worker.tokens_per_bs
        self.capture_bs = compute_capture_bs(self.layout, worker.spec.capture_bs, worker.spec.max_running_requests)
        self.max_bs = max(self.capture_bs)
        self.buffers = buffers if buffers is not None else DraftExtendInputBuffers.allocate(worker)
        self.graphs: dict[int, object] = {}
        self.capture_batches: dict[int, ForwardBatch] = {}  # the frozen batch each bucket's graph was captured with

    @property
    def comm(self):
        return self.worker.ctx.comm

    def can_run(self, inp: DraftExtendInputs) -> bool:
        """A batch that carries return_logprob needs a logprob tail the graph, captured with the flag off, has not
        (get_forward_batch bakes return_logprob False): it runs eagerly. The draft worker resets the flag
        (runners.draft_extend.without_logprob), so a draft batch never carries it; one that did would make this a
        DP group's own decision, and under the MLP-TP gather one group would replay while another ran eagerly,
        their collectives apart (SGLang gathers can_run_draft_cuda_graph over the DP groups for that reason)."""
        return not inp.return_logprob and super().can_run(inp)

    def _step(self, fb: ForwardBatch) -> StepOutputs:
        """The step body this runner graphs (vLLM's shapes: the ragged body, the PIECEWISE one)."""
        return draft_extend_step(self.worker, self.step, fb)

    @property
    def attn_backend(self):
        return self.worker.attn

    def _body(self, fb: ForwardBatch) -> StepOutputs:
        out = self._step(fb)
        n = fb.batch_size * self.T
        self.next_token_logits_buffer[:n].copy_(out.logits)
        out.logits = self.next_token_logits_buffer[:n]
        return out

    def _replay_filled(self, inp: DraftExtendInputs, bs: int) -> StepOutputs:
        """Replays bucket bs over buffers the caller has filled; the raw rows come out."""
        out: StepOutputs = self._replay_graph(bs, self.worker.attn)
        return out.sliced(inp.bs, self.T)


for _f in fields(DraftExtendInputBuffers):
    setattr(DraftExtendCudaGraphRunner, _f.name, _buffer(_f.name))
