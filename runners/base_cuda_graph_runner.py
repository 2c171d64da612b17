"""BaseCudaGraphRunner: what every CUDA-graph runner of the engine does the same way: capture per bucket, choose a
bucket.

The four runners differ in their buffers, their `get_forward_batch(bs)` and their replay fill; they share the capture
loop (two warm-ups with the capture-time metadata, a barrier after each: WARMUPS; then the capture, largest bucket
first) and the bucket rule (the smallest captured bs >= the batch; in the MLP-TP gather branch every DP group replays
the same bucket, so the largest group's batch decides), the gathered token-count tensors with their
capture-time bake, and the replay itself (a host re-plan for backends that plan outside the graph, then the graph).
SGLang splits this between BaseCudaGraphRunner (the capture sizes, the bucket rule) and DecodeCudaGraphRunner, which
the draft runners there subclass; ours subclass this class alone, since our DecodeCudaGraphRunner
(runners.decode_cuda_graph_runner) is the target's TARGET_VERIFY runner only, its buffers its own.
"""
from __future__ import annotations

import bisect
from enum import StrEnum
from typing import Any, Optional, Protocol

import torch

from runners.batch import ForwardBatch
from runners.dp_metadata import GatheredMetadata
from runners.graph.backend import GraphBackend
from runners.parallel.comm import Group
from runners.parallel.layout import Branch, ParallelLayout


def compute_capture_bs(layout: ParallelLayout, configured: tuple[int, ...] | list[int], max_running_requests: int,
                       tokens_per_bs: int = 1) -> list[int]:
    """Buckets whose model input splits over the base, that fit the request pool (rounded up to the
    base), plus that rounded pool where it cut the list or nothing else was kept.

    The input is bs * tokens_per_bs tokens: the target verify passes its num_tokens_per_bs, since
    the attn-TP ranks split its tokens, not its requests; the draft runners keep the default 1.
    Two-batch overlap splits requests between its micro-batches, so with it bs itself must split.
    """
    base = layout.capture_bs_base
    width = 1 if layout.enable_two_batch_overlap else tokens_per_bs
    pool = -(-max_running_requests // base) * base
    kept = {b for b in configured if b * width % base == 0 and b <= pool}
    if max(configured) > pool or not kept:
        kept.add(pool)
    return sorted(kept)


def gathered_buffers(layout: ParallelLayout, device: torch.device) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """global_num_tokens_gpu and global_num_tokens_for_logprob_gpu of a graph runner: int32,
    (dp,) in the MLP-TP gather branch, (1,) in the attn-TP gather branch, none in the other."""
    if not layout.require_gathered_buffer:
        return None, None
    n = layout.attn_dp_size if layout.require_mlp_tp_gather else 1
    return torch.zeros(n, dtype=torch.int32, device=device), torch.zeros(n, dtype=torch.int32, device=device)


# Eager warm-ups per bucket before its capture, a world barrier after each, on every graph backend. On a GPU the engine's
# two pay for one-time work (lazy library init, the allocator settling), which a recorded CPU graph has none of; it runs
# them all the same, because a warm-up pass issues the layer's collectives and the barrier its own: the simulated ranks'
# collective trace must be the real ranks' (sim-vs-real compares them with NCCL ranks, whose graphs are CUDA graphs).
WARMUPS = 2


class RunnerKind(StrEnum):
    """Which graph runner: the engine's four CUDA-graph runners of speculative decoding."""

    MULTI_LAYER = "multi_layer"  # a step of MultiLayerEagleMultiStepDraftExtendCudaGraphRunner
    SINGLE_LAYER = "single_layer"  # EAGLEDraftExtendCudaGraphRunner
    DRAFT_DECODE = "draft_decode"  # EAGLEDraftCudaGraphRunner
    TARGET_VERIFY = "target_verify"  # the target's DecodeCudaGraphRunner in TARGET_VERIFY mode
    RAGGED = "ragged"  # a step of the ragged draft-extend (vLLM's drafter prefill shape): RaggedDraftExtendCudaGraphRunner
    PIECEWISE = "piecewise"  # a step of the multi-layer draft-extend under PIECEWISE graphs: PiecewiseDraftExtendCudaGraphRunner


class LiveBatch(Protocol):
    dp_batch_sizes: list[int]
    seq_lens: torch.Tensor

    @property
    def bs(self) -> int: ...


class BaseCudaGraphRunner:
    """Subclasses set layout, backend, T, capture_bs, max_bs, seq_lens, graphs, capture_batches
    and define `comm`, `get_forward_batch(bs)`, `_fill_for_replay(inp)` and `_body(fb)`;
    `_init_gathered` sets the gathered tensors."""

    runner_kind: RunnerKind
    step = 0  # a multi-step runner's step (draft-extend layer); one-pass runners (verify) are step 0
    piecewise_graphs = False  # vLLM's PIECEWISE mode: each bucket's graph broken at the body's graph breaks (runners.graph.piecewise)
    layout: ParallelLayout
    backend: GraphBackend
    capture_bs: list[int]
    max_bs: int
    graphs: dict[int, Any]
    capture_batches: dict[int, ForwardBatch]
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

    @property
    def attn_backend(self) -> Any:
        """The attention backend the body attends with (the draft worker's, the target's)."""
        raise NotImplementedError

    def init_capture_metadata(self, fb: ForwardBatch) -> None:
        """Names a bucket's batch to a backend that plans on the host, before the warm-ups, as the engine's runners call
        the backend's capture init: its passes then plan the bucket's graph wrappers, never an eager pass's."""
        init = getattr(self.attn_backend, "init_forward_metadata_capture_cuda_graph", None)
        if init is not None:
            init(fb)

    def capture(self) -> None:
        for bs in reversed(self.capture_bs):
            fb = self.get_forward_batch(bs).frozen()
            self.capture_batches[bs] = fb
            self.init_capture_metadata(fb)
            for _ in range(WARMUPS):  # the engine's warm-ups, with the capture-time metadata, a barrier after each
                self.backend.warmup(lambda fb=fb: self._body(fb))
                self.comm.barrier(Group.WORLD)
            self.graphs[bs] = self.backend.capture(lambda fb=fb: self._body(fb), piecewise=self.piecewise_graphs)

    def can_run(self, inp: LiveBatch) -> bool:
        return self._needed_bs(inp) <= self.max_bs

    def _needed_bs(self, inp: LiveBatch) -> int:
        if self.layout.branch is Branch.MLP_TP_GATHER:
            return max(inp.dp_batch_sizes)  # every DP group must replay the same bucket
        return inp.bs

    def _choose_bucket(self, needed: int) -> int:
        return self.capture_bs[bisect.bisect_left(self.capture_bs, needed)]

    # ---- the gathered token counts (int32, (dp,) in the MLP branch, (1,) in the attn branch) ----
    def _init_gathered(self, device: torch.device) -> None:
        self.global_num_tokens_gpu, self.global_num_tokens_for_logprob_gpu = gathered_buffers(self.layout, device)

    def _bake_gathered(self, meta: GatheredMetadata) -> None:
        """What the capture of this bucket sees in the gathered tensors."""
        if self.global_num_tokens_gpu is not None:
            self.global_num_tokens_gpu.copy_(torch.tensor(meta.global_num_tokens, dtype=torch.int32))
            self.global_num_tokens_for_logprob_gpu.copy_(torch.tensor(meta.global_num_tokens_for_logprob, dtype=torch.int32))

    # ---- replay ----
    def _fill_for_replay(self, inp: Any) -> int:
        raise NotImplementedError

    def prepare_replay(self, inp: Any) -> int:
        """Copy in, choose the bucket, write the replay fill; returns the bucket. No graph runs."""
        return self._fill_for_replay(inp)

    def _replay_graph(self, bs: int, attn: Any) -> Any:
        """Replays the bucket's graph over the filled buffers; returns the graph's (unsliced) output."""
        replan = getattr(attn, "init_forward_metadata_replay_cuda_graph", None)
        if replan is not None:  # host-planned backends (flashinfer): re-plan with the live lanes, outside the graph
            replan(self.capture_batches[bs])
        graph = self.graphs[bs]
        self.backend.replay(graph)
        return graph.output
