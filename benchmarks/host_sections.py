"""Where a graphed speculative iteration's host time goes, by section, without a profiler
(`benchmarks/profile_iter.py --sections`).

torch.profiler's CUPTI tracing makes every cudaGraphLaunch pay per captured node, so its host
numbers overstate graph launches; here each section is a perf_counter around the call, inclusive
of what it calls (nested sections overlap), per iteration of the runner rig (draft-extend, draft
decode, verify back to back, as `harness bench` times it).
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch

from harness.bench.command import _model
from harness.bench.runners import _runner_calls, build_rig, rig_spec
from harness.bench.timer import Timer
from harness.run.scenario import release
from runners import (
    decode_cuda_graph_runner,
    draft_extend_graph_driver,
    eagle_draft_cuda_graph_runner,
    eagle_draft_extend_cuda_graph_runner,
)
from runners.graph import backend as graph_backend

_SPENT: dict[str, float] = defaultdict(float)
_CALLS: dict[str, int] = defaultdict(int)


def _timed(owner: Any, name: str, label: str) -> None:
    fn: Callable = getattr(owner, name)

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _SPENT[label] += time.perf_counter() - t0
            _CALLS[label] += 1

    setattr(owner, name, timed)


def instrument(flashinfer: bool) -> None:
    _timed(draft_extend_graph_driver.DraftExtendGraphDriver, "run", "extend")
    _timed(eagle_draft_cuda_graph_runner.EAGLEDraftCudaGraphRunner, "replay", "decode")
    _timed(decode_cuda_graph_runner.DecodeCudaGraphRunner, "replay", "verify")
    for cls, label in ((eagle_draft_extend_cuda_graph_runner.EAGLEDraftExtendCudaGraphRunner, "extend"),
                       (eagle_draft_cuda_graph_runner.EAGLEDraftCudaGraphRunner, "decode"),
                       (decode_cuda_graph_runner.DecodeCudaGraphRunner, "verify")):
        _timed(cls, "_fill_for_replay", f"  {label} fill")
    _timed(graph_backend.CudaGraph, "replay", "  graph launch (all runners)")
    if flashinfer:
        from runners.attention import flashinfer_backend as fb  # the optional extra: only when it is measured

        cls = fb.FlashInferAttnBackend
        _timed(cls, "init_forward_metadata_replay_cuda_graph", "  plan before replay (all runners)")
        _timed(cls, "_host_seq_lens", "    host seq_lens (+ chain check)")
        _timed(cls, "_plan_args", "    plan args (extend, verify)")
        _timed(cls, "_draft_plan_args", "    plan args (decode)")
        _timed(fb, "kv_index_plan", "      kv_index_plan (host lengths)")
        _timed(cls, "_plan", "    write buffers + plan")
        _timed(cls, "_staging", "      wait for the staging buffer")
        _timed(cls, "_replan", "      flashinfer planner (C++)")


def graph_iterations(comm, backend: str, model_choice: str, dtype: str, bs_list: list[int], warmup: int = 5) -> Iterator[tuple]:
    """Per batch size: (bs, i, rig, batch, graph calls), the graphed iteration warmed up and the device idle; the
    batch's requests are released when the caller moves on."""
    _, model = _model(model_choice, backend, dtype)
    rig = build_rig(comm, model, rig_spec(tuple(bs_list)), backend, torch.device("cuda"), "cuda")
    for i, bs in enumerate(bs_list):
        batch = rig.batch(bs, 1000 * (i + 1))
        _, graph = _runner_calls(rig, batch.inputs, rig.decode_inputs(batch, seed=i), rig.verify_lanes(batch, seed=i))
        for _ in range(warmup):
            graph["iteration"]()
        torch.cuda.synchronize()
        yield bs, i, rig, batch, graph
        release(rig.worker, batch)


def sections(comm, backend: str, model_choice: str, dtype: str, bs_list: list[int], reps: int) -> str:
    timer = Timer(torch.device("cuda"))
    out = []
    for bs, _, _, _, graph in graph_iterations(comm, backend, model_choice, dtype, bs_list, warmup=10):
        it = graph["iteration"]
        _SPENT.clear()
        _CALLS.clear()
        t0 = time.perf_counter()
        for _ in range(reps):
            it()
        host = (time.perf_counter() - t0) * 1e3 / reps
        torch.cuda.synchronize()
        spent = {k: v * 1e3 / reps for k, v in _SPENT.items()}
        calls = {k: v / reps for k, v in _CALLS.items()}
        events = statistics.median(timer.measure(it, reps, 5))
        out.append(f"=== {backend} {model_choice} {dtype} bs {bs}: host {host:.3f} ms/iter (no sync), events {events:.3f} ms/iter")
        for k, v in spent.items():
            out.append(f"{k:<44} {v:8.3f} ms  x{calls[k]:.0f}")
    return "\n".join(out)
