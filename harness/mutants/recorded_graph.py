"""Mutants only a graph that replays kernels, not Python, shows (runners.graph.record)."""
from __future__ import annotations

from dataclasses import replace
from unittest import mock

import torch

from harness.mutants.base import Mutant
from harness.mutants.draft_extend import REAL_COPY, REAL_GET_FORWARD_BATCH
from runners.attention.torch_ref import AttnMetadata, TorchAttnBackend

# ---- issue 15: bugs only a graph that replays kernels, not Python, shows ----
# Each body is correct whenever its Python runs with live host state, so a CPU graph that
# re-ran the body at replay passed them all; the recorded graph (runners.graph.record)
# freezes host values at capture and refuses host reads, as a CUDA graph does.
from runners.draft_extend import SEQ_LEN_FILL_VALUE
from runners.draft_extend_graph_driver import DraftExtendGraphDriver
from runners.memory import ReqToTokenPool
from runners.multi_layer_eagle_draft_extend_cuda_graph_runner import MultiLayerEagleDraftExtendCudaGraphRunner

_REAL_BODY = MultiLayerEagleDraftExtendCudaGraphRunner._body
_REAL_TORCH_METADATA = TorchAttnBackend.init_forward_metadata
_REAL_REQ_ALLOC = ReqToTokenPool.alloc


def _keys_below(meta: AttnMetadata, kv_len: int) -> AttnMetadata:
    """Attention over key positions [0, kv_len) only: exact while kv_len >= every live seq_len (the rest is masked)."""
    return AttnMetadata(meta.token_to_req, meta.kv_slots[:, :kv_len], meta.key_mask[:, :kv_len])


def _forward_batch_sets_host_max_seq_len(self: MultiLayerEagleDraftExtendCudaGraphRunner, bs: int):
    self.host_max_seq_len = SEQ_LEN_FILL_VALUE  # the bucket's batch: every seq_len is the fill value
    return REAL_GET_FORWARD_BATCH(self, bs)


def _copy_sets_host_max_seq_len(self: MultiLayerEagleDraftExtendCudaGraphRunner, inp) -> None:
    REAL_COPY(self, inp)
    self.host_max_seq_len = int(inp.seq_lens.max()) if inp.bs else SEQ_LEN_FILL_VALUE  # outside the graph: a legal host read


def _body_keys_below_host_max_seq_len(self: MultiLayerEagleDraftExtendCudaGraphRunner, fb):
    attn, kv_len = self.worker.attn, self.host_max_seq_len  # a runner attribute the body reads on the host

    def metadata(fb):
        return _keys_below(_REAL_TORCH_METADATA(attn, fb), kv_len)

    with mock.patch.object(attn, "init_forward_metadata", metadata):
        return _REAL_BODY(self, fb)


def _alloc_rebinds_req_to_token(self: ReqToTokenPool) -> int:
    idx = _REAL_REQ_ALLOC(self)
    self.req_to_token = self.req_to_token.clone()  # copy-on-write: the new row goes to a new table, not the captured one
    return idx


def _metadata_reads_max_seq_len(self: TorchAttnBackend, fb) -> AttnMetadata:
    kv_len = int(fb.seq_lens.max()) if fb.seq_lens.numel() else SEQ_LEN_FILL_VALUE  # a device-to-host read in the step body
    return _keys_below(_REAL_TORCH_METADATA(self, fb), kv_len)


def _metadata_bounded_by_host_mirror(self: TorchAttnBackend, fb) -> AttnMetadata:
    """Keys below the batch's longest seq_len, read from its host mirror inside the body (as a backend that reads
    max(seq_lens_cpu) for a kernel bound): live wherever the Python runs; under a graph a host op, run at capture."""
    meta = _REAL_TORCH_METADATA(self, fb)
    host = fb.seq_lens_cpu
    if host is None or not host.numel():
        return meta
    longest = host.max()  # on a GPU: host memory, read once, at capture
    key_pos = torch.arange(meta.key_mask.shape[1], device=meta.key_mask.device)
    return AttnMetadata(meta.token_to_req, meta.kv_slots, meta.key_mask & (key_pos[None, :] < longest))


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "kv-len-from-host-attribute",
        "the draft-extend body limits attention to the keys below a max seq_len the runner keeps on the host (set by "
        "get_forward_batch, then by each replay's copy-in): correct whenever the body's Python runs, but a graph bakes "
        "the capture-time value (the fill seq_len), so replays attend one key. A CPU graph that re-ran the body passed it",
        "host value frozen at capture",
        (
            (MultiLayerEagleDraftExtendCudaGraphRunner, "get_forward_batch", _forward_batch_sets_host_max_seq_len),
            (MultiLayerEagleDraftExtendCudaGraphRunner, "_copy_live_inputs", _copy_sets_host_max_seq_len),
            (MultiLayerEagleDraftExtendCudaGraphRunner, "_body", _body_keys_below_host_max_seq_len),
        ),
        ("case-tp1", "spec-cases"),  # P3, P4; P6
    ),
    Mutant(
        "req-to-token-rebound",
        "ReqToTokenPool.alloc copies the request map to a new tensor (copy-on-write) instead of writing the row in "
        "place: the step body reads worker.req_pool.req_to_token live, so a body re-run sees the new table, but a "
        "graph keeps the table it captured and replays with stale KV slot rows",
        "static buffer rebound after capture",
        ((ReqToTokenPool, "alloc", _alloc_rebinds_req_to_token),),
        ("case-tp1", "spec-cases"),  # P3, P4; P2, P5, P6, P8
    ),
    Mutant(
        "attn-metadata-host-sync",
        "the reference attention's metadata reads max(seq_lens) to the host (int(t), a device sync) to trim the key "
        "range: exact in eager and in a body re-run, but a CUDA graph capture fails at the read, and so does the CPU "
        "graph's (GraphCaptureError: the run property, as on a GPU)",
        "host sync inside capture",
        ((TorchAttnBackend, "init_forward_metadata", _metadata_reads_max_seq_len),),
        ("case-tp1", "p7-idle-ranks"),  # run: the capture fails at the host read
    ),
    Mutant(
        "multi-layer-keeps-step-output-views",
        "the multi-layer driver hands back each step's outputs as the views its replay returned: the later steps' replays "
        "overwrite them, the logits in the buffer the steps share, the rest in the graph-pool memory the later steps' "
        "graphs freed at capture (a graph writes its outputs in place; the recorded CPU graph too, in its pool)",
        "graph output read after the next replay",
        ((DraftExtendGraphDriver, "kept", staticmethod(lambda out: out)),),
        ("case-tp1",),  # P3 (eager vs graph logits of every step but the last)
    ),
    Mutant(
        "multi-layer-copies-only-logits",
        "the multi-layer driver copies each step's logits (the buffer the steps share) and keeps the rest of its outputs "
        "as views: they sit in graph-pool memory that the later steps' graphs freed at capture (captured last step first) "
        "and rewrite at every replay, so an earlier step's top-k and hidden states read the later steps' intermediates; "
        "killed only because the CPU graphs of one backend share a pool, as CUDA graphs do (runners.graph.pool)",
        "graph output read after another graph's replay",
        ((DraftExtendGraphDriver, "kept", staticmethod(lambda out: replace(out, logits=out.logits.clone()))),),
        ("case-tp1",),  # P3 (eager vs graph, every step but the last)
    ),
    Mutant(
        "kv-bound-from-host-mirror",
        "the reference attention bounds its keys by max(seq_lens_cpu), the batch's host mirror, inside the step body: "
        "live in eager passes and in a graph that re-ran host ops, but on a GPU an op on host memory runs at capture "
        "only, so every replay keeps the capture-time bound (the fill seq_len) and attends one key. The recording CPU "
        "graph runs host-mirror ops at capture only (runners.graph.host), as a GPU capture does",
        "host value frozen at capture",
        ((TorchAttnBackend, "init_forward_metadata", _metadata_bounded_by_host_mirror),),
        ("case-tp1",),  # P3, P4
    ),
)
