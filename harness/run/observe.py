"""The harness's one window into our graph runners: P1's records, taken from outside.

The runners are the system under test and carry no instrumentation. As harness.engines
observes SGLang's runners (wrapping get_forward_batch, capture and the replay prepare on
the engine's own objects), a `RunnerObserver` wraps the bound methods of one runner
INSTANCE (the class is untouched; other instances, other ranks, run unobserved):

- `get_forward_batch(bs)`: right after it returns, the bucket's host metadata and the
  gathered tensors as it baked them (the capture side of invariant I1);
- `replay(inp)`: which live batch the replay is for;
- `_replay_graph(bs, attn)`: the static buffers after the replay fill, read before the
  graph runs; the rows fed to lm_head and the logits rows from its output after.

A runner captured before the observer attached, or never captured (the metadata-only P1
path), has its bucket baked on demand through its public `get_forward_batch(bs)`; the
gathered tensors it overwrites are put back, so the live fill is what the replay reads.
Reading the buffers back is a device sync per replay; an engine run does not attach one.

On the metadata path (`prepare`) the record also carries what the replay writes, field by field (I1 over every
field, harness.props.p1_fields): the static buffers the fill wrote (their version counters moved), each under the
name of the capture field that reads it, sliced to the bucket; and the host values an engine's replay hands the
code outside the graph, derived from the filled buffers as SGLang's replay derives them (`replay_fields`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Optional, Protocol

import torch

from harness.run.records import CaptureRecord, FieldValue, ReplayRecord, batch_fields, field_value, tensor_values
from runners.base_cuda_graph_runner import RunnerKind
from runners.batch import ForwardBatch
from runners.draft_decode import EagleProposer
from runners.draft_extend import SEQ_LEN_FILL_VALUE
from runners.parallel.layout import DpPaddingMode, ParallelLayout
from runners.spec_decode import SpecEngine


class LiveBatch(Protocol):
    seq_lens: torch.Tensor

    @property
    def bs(self) -> int: ...


class ObservedRunner(Protocol):
    """What the observer reads of a graph runner: the engine-shaped names of runners.base_cuda_graph_runner."""

    runner_kind: RunnerKind
    step: int
    layout: ParallelLayout
    T: int
    capture_bs: list[int]
    seq_lens: torch.Tensor
    global_num_tokens_gpu: Optional[torch.Tensor]
    global_num_tokens_for_logprob_gpu: Optional[torch.Tensor]

    def get_forward_batch(self, bs: int) -> ForwardBatch: ...

    def prepare_replay(self, inp: Any) -> int: ...


_WRAPPED = ("get_forward_batch", "replay", "_replay_graph")


class RunnerObserver:
    """Records one runner's captures and replays; `replays` may be a list shared by several observers
    (the steps of one multi-layer runner) so that it holds every replay in the order they ran."""

    def __init__(self, runner: ObservedRunner, replays: Optional[list[ReplayRecord]] = None):
        self.runner = runner
        self.captures: dict[int, CaptureRecord] = {}
        self.replays: list[ReplayRecord] = [] if replays is None else replays
        self._saved: dict[str, Optional[Callable]] = {}
        self._live: Optional[LiveBatch] = None

    # ---- attach / detach: instance attributes over the class's methods, put back in reverse order ----
    def attach(self) -> "RunnerObserver":
        r = self.runner
        for name in _WRAPPED:
            if not hasattr(r, name):
                continue
            self._saved[name] = r.__dict__.get(name)
            setattr(r, name, getattr(self, f"_{name.lstrip('_')}")(getattr(r, name)))
        return self

    def detach(self) -> None:
        for name, prev in self._saved.items():
            if prev is None:
                del self.runner.__dict__[name]
            else:
                setattr(self.runner, name, prev)
        self._saved.clear()

    def __enter__(self) -> "RunnerObserver":
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # ---- the wrappers ----
    def _get_forward_batch(self, original: Callable[[int], ForwardBatch]) -> Callable[[int], ForwardBatch]:
        def get_forward_batch(bs: int) -> ForwardBatch:
            fb = original(bs)
            r = self.runner
            self.captures[bs] = CaptureRecord(fb.batch_size, fb.num_tokens, fb.host_metadata(),
                                              tensor_values(r.global_num_tokens_gpu), tensor_values(r.global_num_tokens_for_logprob_gpu),
                                              batch_fields(fb))
            return fb

        return get_forward_batch

    def _replay(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def replay(inp: LiveBatch, *args: Any, **kwargs: Any) -> Any:
            outer, self._live = self._live, inp
            try:
                return original(inp, *args, **kwargs)
            finally:
                self._live = outer

        return replay

    def _replay_graph(self, original: Callable[[int, Any], Any]) -> Callable[[int, Any], Any]:
        def replay_graph(bs: int, attn: Any) -> Any:
            filled = self.filled(self._live, bs)
            out = original(bs, attn)
            self.replays.append(_with_output(filled, out))
            return out

        return replay_graph

    # ---- records ----
    def capture_record(self, bs: int) -> CaptureRecord:
        """The bucket as baked: observed at capture, else baked now (metadata only), the live fill kept."""
        rec = self.captures.get(bs)
        if rec is not None:
            return rec
        r = self.runner
        saved = [(t, t.clone()) for t in (r.global_num_tokens_gpu, r.global_num_tokens_for_logprob_gpu) if t is not None]
        if "get_forward_batch" in self._saved:
            r.get_forward_batch(bs)
        else:
            self._get_forward_batch(r.get_forward_batch)(bs)
        for t, value in saved:
            t.copy_(value)
        return self.captures[bs]

    def filled(self, inp: Optional[LiveBatch], bs: int) -> ReplayRecord:
        """The static buffers after the replay fill of bucket bs for the live batch `inp`."""
        if inp is None:
            raise RuntimeError(f"{type(self.runner).__name__}: a graph replay outside replay(inp); the observer cannot tell its live batch")
        r = self.runner
        raw_bs = inp.bs
        gpu = r.global_num_tokens_gpu
        return ReplayRecord(
            runner=r.runner_kind,
            step=r.step,
            branch=r.layout.branch.value,
            raw_bs=raw_bs,
            bs=bs,
            tokens_per_bs=r.T,
            capture=self.capture_record(bs),
            global_num_tokens_gpu=tensor_values(gpu),
            global_num_tokens_for_logprob_gpu=tensor_values(r.global_num_tokens_for_logprob_gpu),
            gpu_shape=None if gpu is None else tuple(gpu.shape),
            padded_seq_lens=r.seq_lens[raw_bs:bs].tolist(),
            seq_lens_sum=int(inp.seq_lens.sum()) + (bs - raw_bs) * SEQ_LEN_FILL_VALUE,
            seq_lens_sum_actual=int(r.seq_lens[:bs].sum()),
            captured_bs=list(r.capture_bs),
            host_mirror_stale_lanes=stale_host_mirror(r, bs),
        )

    def prepare(self, inp: LiveBatch) -> ReplayRecord:
        """The fast P1 path: the runner's replay prepare (copy-in and fill, no graph) and its record, with the fields
        the replay wrote."""
        buffers = static_buffers(self.runner)
        before = {name: t._version for name, t in buffers.items()}
        rec = self.filled(inp, self.runner.prepare_replay(inp))
        written = {name: t for name, t in buffers.items() if t._version != before[name]}
        return replace(rec, fields=replay_fields(self.runner, rec, written))

    def take(self) -> list[ReplayRecord]:
        """The replays since the last take, in the order they ran."""
        out = list(self.replays)
        self.replays.clear()
        return out


def stale_host_mirror(r: Any, bs: int) -> Optional[list[int]]:
    """The bucket's lanes whose host mirror (seq_lens_cpu; a verify runner's custom_mask_cpu) differs from the
    device buffer the graph reads: a host-planned backend (flashinfer) plans the replay from the mirror, so a
    stale lane there gets another lane length's plan than the graph's kernels see. None: the runner keeps none."""
    host = getattr(r, "seq_lens_cpu", None)
    if host is None:
        return None
    stale = host[:bs] != r.seq_lens[:bs].cpu()
    mask = getattr(r, "custom_mask_cpu", None)
    if mask is not None:
        stale |= (mask[:bs] != r.custom_mask[:bs].cpu()).flatten(1).any(1)
    return stale.nonzero().flatten().tolist()


GATHERED = ("global_num_tokens_gpu", "global_num_tokens_for_logprob_gpu")  # (dp,) or (1,) whatever the bucket


def static_buffers(r: Any) -> dict[str, torch.Tensor]:
    """A graph runner's static tensors: its own attributes and its input-buffer set's (the draft-extend runners keep
    theirs in one, shared by the steps of a composite)."""
    out = {name: t for name, t in vars(r).items() if isinstance(t, torch.Tensor)}
    held = getattr(r, "buffers", None)
    if held is not None:
        out.update({name: t for name, t in vars(held).items() if isinstance(t, torch.Tensor)})
    return out


def replay_fields(r: Any, rec: ReplayRecord, written: dict[str, torch.Tensor]) -> dict[str, FieldValue]:
    """What the replay of bucket rec.bs writes, as fields of the batch the graph reads.

    Tensors: each buffer the fill wrote, under the name of the capture field that views it (the field whose name is
    the buffer's, the spec info's included), or its own name where no capture field does (then the capture never
    set it); sliced to the bucket's lanes (a buffer of max_bs * w rows gives bs * w; the gathered counts whole).
    Host values: what an engine's replay hands the code outside the graph, from the filled buffers: the bucket, the
    seq-lens sum of its lanes, the gathered counts as host lists and the DP buffer they size (a graph replay pads
    every DP group to the bucket: MAX_LEN), the extend lengths as a host list and their sum.
    A kernel's writes move no version counter: a fill done by one (the CUDA fused fill) shows its host writes only.
    """
    leaf = {path.rsplit(".", 1)[-1]: path for path, fv in rec.capture.fields.items() if fv.kind == "tensor"}
    out: dict[str, FieldValue] = {}
    for name, t in written.items():
        rows = t.shape[0] // r.max_bs if t.dim() and t.shape[0] % r.max_bs == 0 else 0
        view = t if name in GATHERED or not rows else t[: rec.bs * rows]
        out[leaf.get(name, name)] = field_value(view)
    host: dict[str, Any] = {"batch_size": rec.bs, "seq_lens_sum": rec.seq_lens_sum, "dp_padding_mode": DpPaddingMode.MAX_LEN}
    nt, lp = rec.global_num_tokens_gpu, rec.global_num_tokens_for_logprob_gpu
    if nt is not None:
        host.update(global_num_tokens_cpu=nt, global_num_tokens_for_logprob_cpu=lp, global_dp_buffer_len=max(nt) * len(nt))
    ext = static_buffers(r).get("extend_seq_lens")
    if ext is not None:
        lens = [int(x) for x in ext[: rec.bs].tolist()]
        host.update(extend_seq_lens_cpu=lens, extend_num_tokens=sum(lens))
    out.update({name: field_value(x) for name, x in host.items()})
    return out


def _with_output(rec: ReplayRecord, out: Any) -> ReplayRecord:
    """What the graph gave lm_head: its rows_fed output and the logits rows it produced."""
    return replace(rec, rows_fed=int(out.rows_fed), logits_rows=int(out.logits.shape[0]))


def observe_all(runners: Iterable[ObservedRunner]) -> list[RunnerObserver]:
    """One observer per runner, attached, all appending to one list (the first's `replays`)."""
    shared: list[ReplayRecord] = []
    return [RunnerObserver(r, shared).attach() for r in runners]


@dataclass(frozen=True)
class LoopRecords:
    """One engine step's graph replays on one rank, per runner kind, in the order they ran."""

    extend: list[ReplayRecord]  # the draft-extend steps (empty: eager, or a batch no bucket fits)
    verify: list[ReplayRecord]  # the TARGET_VERIFY replay
    decode: list[ReplayRecord]  # the single-layer draft decode


class LoopObserver:
    """Observes the graph runners of one rank's speculative decoding loop (a runners.spec_decode.SpecEngine);
    `take()` after each engine step gives that step's LoopRecords. An eager engine has none to observe."""

    def __init__(self, engine: SpecEngine):
        draft = engine.draft
        driver = draft.driver if isinstance(draft, EagleProposer) else None
        decode = draft.decode_graph if isinstance(draft, EagleProposer) else None
        self.extend = observe_all(driver.runners if driver is not None else ())
        self.verify = observe_all(() if engine.verify_graph is None else (engine.verify_graph,))
        self.decode = observe_all(() if decode is None else (decode,))

    def take(self) -> LoopRecords:
        return LoopRecords(*(obs[0].take() if obs else [] for obs in (self.extend, self.verify, self.decode)))
