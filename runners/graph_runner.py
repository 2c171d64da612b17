"""What every CUDA-graph runner of the engine does the same way: capture per bucket, choose a bucket.

Draft-extend and target verify differ in their buffers, their `get_forward_batch(bs)` and
their replay fill; they share the capture loop (two warm-ups with the capture-time
metadata, a barrier after each, then the capture, largest bucket first, DESIGN.md §6.2) and
the bucket rule (the smallest captured bs >= the batch; in the MLP-TP gather branch every
DP group replays the same bucket, so the largest group's batch decides, §6.4), the gathered
token-count tensors with their capture-time bake, and the replay itself (a host re-plan for
backends that plan outside the graph, then the graph).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch

from runners.batch import ForwardBatch
from runners.dp_metadata import GatheredMetadata
from runners.draft_extend import SEQ_LEN_FILL_VALUE
from runners.graph_backend import GraphBackend
from runners.parallel.comm import Group
from runners.parallel.layout import Branch, ParallelLayout


def compute_capture_bs(layout: ParallelLayout, configured: tuple[int, ...] | list[int], max_running_requests: int) -> list[int]:
    """Buckets: multiples of the base that fit the request pool, plus the rounded pool size if it was cut."""
    base = layout.capture_bs_base
    kept = sorted({b for b in configured if b % base == 0 and b <= max_running_requests})
    if max(configured) > max_running_requests or not kept:
        top = -(-max_running_requests // base) * base
        kept = sorted(set(kept) | {top})
    return kept


def gathered_buffers(layout: ParallelLayout, device: torch.device) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """global_num_tokens_gpu and global_num_tokens_for_logprob_gpu of a graph runner (§6.2): int32,
    (dp,) in the MLP-TP gather branch, (1,) in the attn-TP gather branch, none in the other."""
    if not layout.require_gathered_buffer:
        return None, None
    n = layout.attn_dp_size if layout.require_mlp_tp_gather else 1
    return torch.zeros(n, dtype=torch.int32, device=device), torch.zeros(n, dtype=torch.int32, device=device)


@dataclass
class CaptureRecord:
    """Host and gpu metadata as baked for one bucket (the capture side of invariant I1)."""

    bs: int
    num_tokens: int
    host: dict
    global_num_tokens_gpu: Optional[list[int]]
    global_num_tokens_for_logprob_gpu: Optional[list[int]]


@dataclass
class ReplayRecord:
    """What one replay used: the baked host values of its bucket and the gpu values after the fill."""

    runner: str
    step: int
    branch: str
    raw_bs: int
    bs: int
    tokens_per_bs: int
    capture: CaptureRecord
    global_num_tokens_gpu: Optional[list[int]]
    global_num_tokens_for_logprob_gpu: Optional[list[int]]
    gpu_shape: Optional[tuple[int, ...]]
    padded_seq_lens: list[int]
    seq_lens_sum: int
    seq_lens_sum_actual: int
    rows_fed: Optional[int] = None
    logits_rows: Optional[int] = None
    captured_bs: list[int] = field(default_factory=list)


class LiveBatch(Protocol):
    dp_batch_sizes: list[int]
    seq_lens: torch.Tensor

    @property
    def bs(self) -> int: ...


class BucketedGraphRunner:
    """Subclasses set layout, backend, T, capture_bs, max_bs, seq_lens, graphs, capture_batches,
    capture_records (get_forward_batch fills it) and define `comm`, `get_forward_batch(bs)` and
    `_body(fb)`; `_init_gathered` sets the gathered tensors."""

    runner_kind = "base"
    step = 0  # a multi-step runner's step (draft-extend layer); one-pass runners (verify) are step 0
    layout: ParallelLayout
    backend: GraphBackend
    capture_bs: list[int]
    max_bs: int
    graphs: dict[int, Any]
    capture_batches: dict[int, ForwardBatch]
    capture_records: dict[int, CaptureRecord]
    T: int
    seq_lens: torch.Tensor
    global_num_tokens_gpu: Optional[torch.Tensor]
    global_num_tokens_for_logprob_gpu: Optional[torch.Tensor]

    @property
    def comm(self):
        raise NotImplementedError

    def get_forward_batch(self, bs: int) -> ForwardBatch:
        raise NotImplementedError

    def _body(self, fb: ForwardBatch) -> Any:
        raise NotImplementedError

    def capture(self) -> None:
        for bs in reversed(self.capture_bs):
            fb = self.get_forward_batch(bs).frozen()
            self.capture_batches[bs] = fb
            for _ in range(2):  # warm-up, as the engine does, with the capture-time metadata
                self.backend.warmup(lambda fb=fb: self._body(fb))
                self.comm.barrier(Group.WORLD)
            self.graphs[bs] = self.backend.capture(lambda fb=fb: self._body(fb))

    def can_run(self, inp: LiveBatch) -> bool:
        return self._needed_bs(inp) <= self.max_bs

    def _needed_bs(self, inp: LiveBatch) -> int:
        if self.layout.branch is Branch.MLP_TP_GATHER:
            return max(inp.dp_batch_sizes)  # every DP group must replay the same bucket
        return inp.bs

    def _choose_bucket(self, needed: int) -> int:
        return self.capture_bs[bisect.bisect_left(self.capture_bs, needed)]

    # ---- the gathered token counts (§6.2: int32, (dp,) in the MLP branch, (1,) in the attn branch) ----
    def _init_gathered(self, device: torch.device) -> None:
        self.global_num_tokens_gpu, self.global_num_tokens_for_logprob_gpu = gathered_buffers(self.layout, device)

    def _bake_gathered(self, meta: GatheredMetadata) -> None:
        """What the capture of this bucket sees in the gathered tensors."""
        if self.global_num_tokens_gpu is not None:
            self.global_num_tokens_gpu.copy_(torch.tensor(meta.global_num_tokens, dtype=torch.int32))
            self.global_num_tokens_for_logprob_gpu.copy_(torch.tensor(meta.global_num_tokens_for_logprob, dtype=torch.int32))

    def _keep_capture_record(self, fb: ForwardBatch) -> ForwardBatch:
        """The capture side of invariant I1: the bucket's host values and gathered tensors as baked."""
        self.capture_records[fb.batch_size] = CaptureRecord(
            fb.batch_size, fb.num_tokens, fb.host_metadata(),
            _tolist(self.global_num_tokens_gpu), _tolist(self.global_num_tokens_for_logprob_gpu),
        )
        return fb

    # ---- replay ----
    def _replay_graph(self, bs: int, attn: Any, rec: Optional[ReplayRecord]) -> Any:
        """Replays the bucket's graph over the filled buffers; returns the graph's (unsliced) output."""
        replan = getattr(attn, "init_forward_metadata_replay_cuda_graph", None)
        if replan is not None:  # host-planned backends (flashinfer): re-plan with the live lanes, outside the graph
            replan(self.capture_batches[bs])
        graph = self.graphs[bs]
        self.backend.replay(graph)
        out = graph.output
        if rec is not None:
            rec.rows_fed = int(out.rows_fed)
            rec.logits_rows = int(out.logits.shape[0])
        return out

    def _record(self, inp: LiveBatch, bs: int) -> ReplayRecord:
        """What P1 compares: reads the static buffers back to the host (device syncs; an engine skips this)."""
        raw_bs = inp.bs
        capture = self.capture_records.get(bs) or self._capture_record_for(bs)
        return ReplayRecord(
            runner=self.runner_kind,
            step=self.step,
            branch=self.layout.branch.value,
            raw_bs=raw_bs,
            bs=bs,
            tokens_per_bs=self.T,
            capture=capture,
            global_num_tokens_gpu=_tolist(self.global_num_tokens_gpu),
            global_num_tokens_for_logprob_gpu=_tolist(self.global_num_tokens_for_logprob_gpu),
            gpu_shape=None if self.global_num_tokens_gpu is None else tuple(self.global_num_tokens_gpu.shape),
            padded_seq_lens=self.seq_lens[raw_bs:bs].tolist(),
            seq_lens_sum=int(inp.seq_lens.sum()) + (bs - raw_bs) * SEQ_LEN_FILL_VALUE,
            seq_lens_sum_actual=int(self.seq_lens[:bs].sum()),
            captured_bs=list(self.capture_bs),
        )

    def _capture_record_for(self, bs: int) -> CaptureRecord:
        """Metadata-only mode: bake the bucket's batch without capturing a graph; keep the live fill."""
        saved = (_tolist(self.global_num_tokens_gpu), _tolist(self.global_num_tokens_for_logprob_gpu))
        self.get_forward_batch(bs)
        if saved[0] is not None:
            self.global_num_tokens_gpu.copy_(torch.tensor(saved[0], dtype=torch.int32))
            self.global_num_tokens_for_logprob_gpu.copy_(torch.tensor(saved[1], dtype=torch.int32))
        return self.capture_records[bs]


def _tolist(t: Optional[torch.Tensor]) -> Optional[list[int]]:
    return None if t is None else [int(x) for x in t.tolist()]
