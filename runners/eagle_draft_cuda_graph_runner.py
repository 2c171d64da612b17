"""EAGLEDraftCudaGraphRunner: the whole multi-step draft decode of the single-layer EAGLE draft in one graph per bucket.

As the engine's runner: static topk_p / topk_index / hidden_states (one
row per request), positions (one per lane, bs * topk), seq_lens / req_pool_indices (one per
request) and out_cache_loc (bs * topk * (num_steps - 1)) sized for the largest bucket; its own
capture_bs and `get_forward_batch(bs)`, whose gathered metadata counts bs * topk tokens (DECODE:
every lane gets logits); a replay that copies the live requests in, fills the padded lanes,
writes the gathered counts and replays. The step body is runners.eagle_draft's, shared with
the eager reference, and attends with the worker's backend; a backend that plans on the host
re-plans its per-step metadata before every replay (BaseCudaGraphRunner._replay_graph).
"""
from __future__ import annotations

import torch

from runners.base_cuda_graph_runner import BaseCudaGraphRunner, RunnerKind, compute_capture_bs
from runners.batch import ForwardBatch, ForwardMode, host_copy
from runners.dp_metadata import gathered_metadata
from runners.draft_extend import SEQ_LEN_FILL_VALUE, DraftWorker
from runners.eagle_draft import (
    DraftDecodeInputs,
    DraftDecodeOutputs,
    DraftDecodeSpecInfo,
    draft_decode_forward,
    require_draft_decode,
)
from runners.graph.backend import GraphBackend
from runners.graph.host import host_mirror
from runners.replay_copy import grouped_foreach_copy_


class EAGLEDraftCudaGraphRunner(BaseCudaGraphRunner):
    """One rank's draft-decode graphs (num_steps - 1 forwards of the one draft layer each)."""

    runner_kind = RunnerKind.DRAFT_DECODE

    def __init__(self, worker: DraftWorker, backend: GraphBackend):
        spec = worker.spec
        if spec.num_steps < 2:
            raise ValueError(f"the draft decode runs num_steps - 1 forwards; num_steps {spec.num_steps} leaves none")
        self.worker, self.backend = worker, backend
        self.layout = worker.ctx.layout
        self.topk = spec.topk
        self.T = spec.topk  # lanes per request: the engine's captured_req_width
        self.steps = spec.num_steps - 1
        self.capture_bs = compute_capture_bs(self.layout, spec.capture_bs, spec.max_running_requests)
        self.max_bs = max(self.capture_bs)
        n, dev, cfg = self.max_bs * self.T, worker.device, worker.cfg
        i64 = dict(dtype=torch.int64, device=dev)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.out_cache_loc = torch.full((n * self.steps,), worker.pad.slot, **i64)
        self.seq_lens = torch.full((self.max_bs,), SEQ_LEN_FILL_VALUE, **i64)
        self.seq_lens_cpu = host_mirror(torch.full((self.max_bs,), SEQ_LEN_FILL_VALUE, dtype=torch.int64))  # host mirror: a host plan reads it
        self.req_pool_indices = torch.full((self.max_bs,), worker.pad.row, **i64)
        self.topk_p = torch.zeros(self.max_bs, self.topk, dtype=torch.float32, device=dev)
        self.topk_index = torch.zeros(self.max_bs, self.topk, **i64)
        self.hidden_states = torch.zeros(self.max_bs, cfg.hidden_size, dtype=cfg.torch_dtype, device=dev)
        self.attn = worker.attn  # the case's backend (None: a metadata-only worker); replay re-plans it (graph_runner)
        if self.attn is not None:
            require_draft_decode(self.attn)
        self._init_gathered(dev)
        self.graphs: dict[int, object] = {}
        self.capture_batches: dict[int, ForwardBatch] = {}

    # ---- metadata, per branch: DECODE counts every lane (bs * topk tokens), logits for each ----
    def _capture_num_tokens(self, bs: int) -> int:
        return bs * self.T

    def get_forward_batch(self, bs: int) -> ForwardBatch:
        n = bs * self.T
        num_tokens = self._capture_num_tokens(bs)
        if self.layout.require_mlp_tp_gather:
            tokens = [num_tokens] * self.layout.attn_dp_size
        elif self.layout.require_attn_tp_gather:
            tokens = [num_tokens]
        else:
            tokens = None
        if tokens is not None:
            meta = gathered_metadata(self.layout, tokens, tokens, self.worker.ctx.attn_dp_rank if len(tokens) > 1 else 0)
            self._bake_gathered(meta)
            host = dict(global_num_tokens_cpu=meta.global_num_tokens, global_num_tokens_for_logprob_cpu=meta.global_num_tokens_for_logprob,
                        global_dp_buffer_len=meta.global_dp_buffer_len)
        else:
            host = {}
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=self.seq_lens_cpu[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            out_cache_loc=self.out_cache_loc[: n * self.steps],
            extend_seq_lens=self.seq_lens[:0],  # DECODE extends nothing
            extend_start_loc=self.seq_lens[:0],
            spec_info=DraftDecodeSpecInfo(self.topk_p[:bs], self.topk_index[:bs], self.hidden_states[:bs], self.topk),
            num_token_non_padded=n,
            seq_lens_sum=bs * SEQ_LEN_FILL_VALUE,
            global_num_tokens_gpu=self.global_num_tokens_gpu,
            global_num_tokens_for_logprob_gpu=self.global_num_tokens_for_logprob_gpu,
            **host,
        )
        return fb

    # ---- capture ----
    def _body(self, fb: ForwardBatch) -> DraftDecodeOutputs:
        return draft_decode_forward(self.worker, fb)

    @property
    def comm(self):
        return self.worker.ctx.comm

    @property
    def attn_backend(self):
        return self.attn

    # ---- replay ----
    def _fill_padded_lanes(self, raw_bs: int, bs: int) -> None:
        """Padded lanes get the padding row, the fill seq_len, position 0 and zero top-k / hidden state.

        What each fill guards here: the body looks every lane's KV write slots up as
        req_to_token[req_pool_indices[b], seq_lens[b] + ...], so a stale request row writes into that
        request's prefix KV (with row 0 every entry is the padding slot, whatever the seq_len); positions
        index the rotary table and topk_index the embedding, with no clamp, so a stale or garbage value
        past either reads out of bounds; seq_lens is what the padded lanes' metadata reports (seq_lens_sum).
        topk_p and hidden_states only feed the padded lanes' own rows (no op here mixes rows of different
        lanes but the attention, whose keys are per lane), so their zeroing keeps NaN out of buffers, not
        out of results; the engine zeroes them too. out_cache_loc needs no fill: the body writes it for
        the whole bucket before the first step.
        """
        if bs == raw_bs:
            return
        self.seq_lens.fill_(SEQ_LEN_FILL_VALUE)
        self.seq_lens_cpu.fill_(SEQ_LEN_FILL_VALUE)
        self.req_pool_indices.fill_(self.worker.pad.row)
        self.positions.zero_()
        self.topk_p.zero_()  # feeds only the padded lanes' own rows: keeps NaN out of the buffer, no output differs
        self.topk_index.zero_()
        self.hidden_states.zero_()  # likewise

    def _copy_live_inputs(self, inp: DraftDecodeInputs) -> None:
        raw_bs = inp.bs
        grouped_foreach_copy_(
            [self.seq_lens[:raw_bs], self.positions[: raw_bs * self.T], self.topk_p[:raw_bs], self.topk_index[:raw_bs],
             self.req_pool_indices[:raw_bs], self.seq_lens_cpu[:raw_bs]],
            [inp.seq_lens, inp.positions, inp.topk_p, inp.topk_index, inp.req_pool_indices, host_copy(inp.seq_lens_cpu, inp.seq_lens)],
        )
        self.hidden_states[:raw_bs].copy_(inp.hidden_states)  # a plain copy: large and contiguous

    def _fill_for_replay(self, inp: DraftDecodeInputs) -> int:
        bs = self._choose_bucket(self._needed_bs(inp))
        self._fill_padded_lanes(inp.bs, bs)
        self._copy_live_inputs(inp)
        if self.global_num_tokens_gpu is not None:
            self.global_num_tokens_gpu.fill_(bs * self.T)
            self.global_num_tokens_for_logprob_gpu.fill_(bs * self.T)
        return bs

    def replay(self, inp: DraftDecodeInputs) -> DraftDecodeOutputs:
        bs = self._fill_for_replay(inp)
        out: DraftDecodeOutputs = self._replay_graph(bs, self.attn)
        return out.sliced(inp.bs, self.T)
