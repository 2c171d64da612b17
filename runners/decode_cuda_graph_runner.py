"""DecodeCudaGraphRunner: the target's CUDA-graph runner, in TARGET_VERIFY mode: the target model over
num_draft_tokens tokens per request.

SGLang's DecodeCudaGraphRunner (cuda_graph_runner.CudaGraphRunner in older releases) captures the target's graphs in
TARGET_VERIFY mode when speculative decoding is on, and DECODE otherwise; this engine graphs the target only to verify
(its other forwards run eagerly), so ours has the TARGET_VERIFY mode only, and buffers of its own (the tree masks, the
output rows). The draft runners, which subclass SGLang's, subclass runners.base_cuda_graph_runner here.

As the engine's runner in TARGET_VERIFY mode (its replay fill: docs/replay-fill.md): static
buffers sized for the largest bucket; one graph per capture_bs bucket; `get_forward_batch(bs)`
bakes the per-branch gathered metadata, counting tokens (bs * num_draft_tokens) with
logits for every token; replay copies the live lanes in, writes the replay fill into the
padded lanes and the gathered gpu tensors, replays and slices the real rows out. The body
is `runners.target.target_step`, the one the eager verify runs.

Chain and tree verify alike: every lane is a tree of T nodes (runners.verify; a chain is the
tree whose mask is lower-triangular), its mask a static [max_bs, T, T] buffer that the
attention backend reads inside the graph; replay copies the live lanes' masks in and resets
the padded lanes' to the canonical chain mask.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from runners.base_cuda_graph_runner import BaseCudaGraphRunner, RunnerKind, compute_capture_bs
from runners.batch import EagleVerifyInput, ForwardBatch, ForwardMode, host_copy
from runners.config import ModelConfig, SpecConfig, draft_input_hidden_size
from runners.dp_metadata import gathered_metadata
from runners.draft_extend import SEQ_LEN_FILL_VALUE
from runners.graph.backend import GraphBackend
from runners.graph.host import host_mirror
from runners.memory import lane_padding
from runners.parallel.dp_attention import RankContext
from runners.replay_copy import grouped_foreach_copy_
from runners.target import Lane, TargetOutput, TargetRunner, target_step
from runners.verify import chain_mask, tree_mask


@dataclass
class VerifyInputs:
    """One rank's verify batch: num_draft_tokens tree nodes per request (the last token, then the draft's)."""

    input_ids: torch.Tensor  # [bs*T]
    positions: torch.Tensor  # [bs*T] root position + node depth
    seq_lens: torch.Tensor  # [bs] root position + T
    req_pool_indices: torch.Tensor  # [bs]
    dp_batch_sizes: list[int]  # every DP group's bs (from the MLP sync); [bs] without DP attention
    custom_mask: Optional[torch.Tensor] = None  # [bs, T, T] bool: the tree mask of every lane (None: chains)
    parents: list[list[int]] = field(default_factory=list)  # host: every lane's tree (what built the mask); [] for chains
    seq_lens_cpu: Optional[torch.Tensor] = None  # [bs] host copies, as the scheduler knows them (None: not kept)
    custom_mask_cpu: Optional[torch.Tensor] = None  # [bs, T, T]

    @property
    def bs(self) -> int:
        return int(self.seq_lens.shape[0])


def verify_inputs(lanes: Sequence[Lane], dp_batch_sizes: list[int], device: torch.device, T: Optional[int] = None) -> VerifyInputs:
    """Verify lanes (trees of one size T; a lane without parents is a chain) as the runner's live batch
    (T: the tree size, needed when this rank has no lane)."""
    i64 = dict(dtype=torch.int64, device=device)
    flat = lambda xs: torch.tensor([x for lane_xs in xs for x in lane_xs], **i64)  # noqa: E731
    parents = [list(lane.parents) if lane.parents is not None else list(range(-1, len(lane.tokens) - 1)) for lane in lanes]
    T = len(lanes[0].tokens) if lanes else T or 0
    masks = torch.stack([tree_mask(p) for p in parents]) if parents else torch.zeros(0, T, T, dtype=torch.bool)
    seq_lens = torch.tensor([lane.seq_len for lane in lanes], dtype=torch.int64)
    return VerifyInputs(
        input_ids=flat([lane.tokens for lane in lanes]),
        positions=flat([Lane(lane.req_pool_idx, lane.start, lane.tokens, p).positions for lane, p in zip(lanes, parents, strict=True)]),
        seq_lens=seq_lens.to(device),
        req_pool_indices=torch.tensor([lane.req_pool_idx for lane in lanes], **i64),
        dp_batch_sizes=list(dp_batch_sizes),
        custom_mask=masks.to(device),
        parents=parents,
        seq_lens_cpu=seq_lens,
        custom_mask_cpu=masks,
    )


class DecodeCudaGraphRunner(BaseCudaGraphRunner):
    """One rank's TARGET_VERIFY graphs of the target. `target=None` gives a metadata-only runner (no model:
    get_forward_batch and prepare_replay only), which the fast P1 path drives."""

    runner_kind = RunnerKind.TARGET_VERIFY

    def __init__(self, ctx: RankContext, cfg: ModelConfig, spec: SpecConfig, target: Optional[TargetRunner],
                 backend: GraphBackend, device: torch.device | str = "cpu"):
        self.ctx, self.cfg, self.target, self.backend = ctx, cfg, target, backend
        self.layout = ctx.layout
        self.T = spec.num_tokens_per_bs
        self.capture_bs = compute_capture_bs(self.layout, spec.capture_bs, spec.max_running_requests, tokens_per_bs=self.T)
        self.max_bs = max(self.capture_bs)
        n, dev = self.max_bs * self.T, torch.device(device)
        i64 = dict(dtype=torch.int64, device=dev)
        self.pad = lane_padding(spec.padding_convention)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.out_cache_loc = torch.full((n,), self.pad.slot, **i64)
        self.seq_lens = torch.full((self.max_bs,), SEQ_LEN_FILL_VALUE, **i64)
        self.seq_lens_cpu = host_mirror(torch.full((self.max_bs,), SEQ_LEN_FILL_VALUE, dtype=torch.int64))  # host mirrors: a host plan reads these
        self.req_pool_indices = torch.full((self.max_bs,), self.pad.row, **i64)
        self.extend_seq_lens = torch.full((self.max_bs,), self.T, **i64)
        self.extend_start_loc = torch.arange(self.max_bs, **i64) * self.T
        self.chain_mask_cpu = host_mirror(chain_mask(self.T))  # the canonical mask of a padded lane
        self.chain_mask = chain_mask(self.T).to(dev)  # its own memory on CPU too: a device tensor is never a host mirror
        self.custom_mask = self.chain_mask.repeat(self.max_bs, 1, 1)
        self.custom_mask_cpu = host_mirror(self.chain_mask_cpu.repeat(self.max_bs, 1, 1))
        rows = n if target is not None else 0  # outputs only; a metadata-only runner never runs the body
        # what the draft reads: the last hidden states, or an EAGLE3 draft's captured layers side by side
        self.hidden_buffer = torch.zeros(rows, draft_input_hidden_size(cfg, spec), dtype=cfg.torch_dtype, device=dev)
        self.logits_buffer = torch.zeros(rows, cfg.vocab_size, dtype=torch.float32, device=dev)
        self._init_gathered(dev)
        self.graphs: dict[int, object] = {}
        self.capture_batches: dict[int, ForwardBatch] = {}

    # ---- metadata, per branch: every count is tokens, and every token gets logits ----
    def get_forward_batch(self, bs: int) -> ForwardBatch:
        n = bs * self.T
        meta = gathered_metadata(self.layout, [n] * self.layout.attn_dp_size, [n] * self.layout.attn_dp_size, self.ctx.attn_dp_rank)
        self._bake_gathered(meta)
        fb = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=self.seq_lens_cpu[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            out_cache_loc=self.out_cache_loc[:n],
            extend_seq_lens=self.extend_seq_lens[:bs],
            extend_start_loc=self.extend_start_loc[:bs],
            spec_info=EagleVerifyInput(self.T, self.custom_mask[:bs], self.custom_mask_cpu[:bs]),
            extend_seq_lens_cpu=[self.T] * bs,
            extend_num_tokens=n,
            num_token_non_padded=n,
            seq_lens_sum=bs * SEQ_LEN_FILL_VALUE,
            global_num_tokens_cpu=meta.global_num_tokens,
            global_num_tokens_gpu=self.global_num_tokens_gpu,
            global_num_tokens_for_logprob_cpu=meta.global_num_tokens_for_logprob,
            global_num_tokens_for_logprob_gpu=self.global_num_tokens_for_logprob_gpu,
            global_dp_buffer_len=meta.global_dp_buffer_len,
        )
        return fb

    # ---- capture ----
    def _body(self, fb: ForwardBatch) -> TargetOutput:
        out = target_step(self.target, fb)
        n = fb.batch_size * self.T
        self.hidden_buffer[:n].copy_(out.hidden)
        self.logits_buffer[:n].copy_(out.logits)
        return TargetOutput(self.hidden_buffer[:n], self.logits_buffer[:n], out.rows_fed)

    @property
    def comm(self):
        return self.ctx.comm

    @property
    def attn_backend(self):
        return self.target.attn

    # ---- replay ----
    def _copy_live_inputs(self, inp: VerifyInputs) -> None:
        raw_bs = inp.bs
        raw_n = raw_bs * self.T
        if inp.custom_mask is None:  # chains
            mask, host_mask = self.chain_mask.expand(raw_bs, -1, -1), self.chain_mask_cpu.expand(raw_bs, -1, -1)
        else:
            mask, host_mask = inp.custom_mask, host_copy(inp.custom_mask_cpu, inp.custom_mask)
        grouped_foreach_copy_(
            [self.input_ids[:raw_n], self.positions[:raw_n], self.seq_lens[:raw_bs], self.req_pool_indices[:raw_bs],
             self.custom_mask[:raw_bs], self.seq_lens_cpu[:raw_bs], self.custom_mask_cpu[:raw_bs]],
            [inp.input_ids, inp.positions, inp.seq_lens, inp.req_pool_indices,
             mask, host_copy(inp.seq_lens_cpu, inp.seq_lens), host_mask],
        )

    def _fill_padded_lanes(self, raw_bs: int, bs: int) -> None:
        """The replay fill of the bucket's padded lanes [raw_bs, bs) (they hold the last, larger batch's
        values); with no padding there is none, and lanes past the bucket are never read.

        req_pool_indices and positions: the body looks every KV write slot up as
        req_to_token[row, position]; a padded lane left on a larger batch's row writes its KV
        into that request's slots, which may belong to a request still running. Row 0 is the
        padding row (every entry the padding slot), so the fill makes padded writes harmless.
        Positions also gather the rotary table, which has max_context_len rows: position 0 is
        always in it. seq_lens: the fill value, so that the baked seq_lens_sum (raw sum +
        padded lanes * fill) is the buffer's sum. input_ids only shape the padded rows themselves
        (sliced off; each row's logits are its own); they are reset as the engine resets them.
        out_cache_loc needs no fill here, unlike the engine's (which copies its write slots in):
        the body writes it for the whole bucket before any KV write. custom_mask: the chain mask, so every
        padded node sees its root (the padding slot), never nothing: a stale mask that hides the
        root gives a row with no visible key.
        """
        if bs == raw_bs:  # as the engine: the padded region is reset only when there is one
            return
        raw_n, n = raw_bs * self.T, bs * self.T
        self.seq_lens[raw_bs:bs].fill_(SEQ_LEN_FILL_VALUE)
        self.input_ids[raw_n:n].zero_()
        self.positions[raw_n:n].zero_()
        self.req_pool_indices[raw_bs:bs].fill_(self.pad.row)
        self.custom_mask[raw_bs:bs].copy_(self.chain_mask)
        self.seq_lens_cpu[raw_bs:bs].fill_(SEQ_LEN_FILL_VALUE)
        self.custom_mask_cpu[raw_bs:bs].copy_(self.chain_mask_cpu)

    def _fill_gathered(self, bs: int) -> None:
        """The logits gather reads its row counts from these: bs * T per DP group, as baked at capture."""
        if self.global_num_tokens_gpu is not None:
            self.global_num_tokens_gpu.fill_(bs * self.T)
            self.global_num_tokens_for_logprob_gpu.fill_(bs * self.T)

    def _fill_for_replay(self, inp: VerifyInputs) -> int:
        """Copy-in and replay fill; returns the bucket. Device work and host copies only: no device sync when inp carries its host lengths."""
        bs = self._choose_bucket(self._needed_bs(inp))
        self._copy_live_inputs(inp)
        self._fill_padded_lanes(inp.bs, bs)
        self._fill_gathered(bs)
        return bs

    def replay(self, inp: VerifyInputs) -> TargetOutput:
        bs = self._fill_for_replay(inp)
        out: TargetOutput = self._replay_graph(bs, self.target.attn)
        n = inp.bs * self.T
        return TargetOutput(out.hidden[:n], out.logits[:n], out.rows_fed)  # views, as the engine's (runners.outputs)
