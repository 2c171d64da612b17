"""Where a graphed speculative iteration spends its host time: torch.profiler over the runner rig's
graph iteration (draft-extend, draft decode, verify back to back, no P1 records), per backend.

    python benchmarks/profile_iter.py [--backends torch,triton,flashinfer] [--model hd64] [--bs 2,8] [--sections] > profile.txt

Per backend and batch size: the host time of one iteration (perf_counter around the calls,
no sync) against its device time (CUDA events), then the profiler's ops by self CPU time.
A device sync inside the iteration shows as a cudaStreamSynchronize / aten::item / _local_scalar_dense row.
CUPTI's tracing makes every graph launch pay per captured node, so the profiler overstates host time;
--sections times the runners' and the flashinfer plan's own steps with perf_counter instead
(benchmarks/host_sections.py).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import host_sections
from harness.bench.runners import _runner_calls
from harness.bench.timer import Timer
from harness.ranks.simulated import SimulatedWorld
from runners.attention import BACKENDS
from runners.parallel.layout import ParallelLayout


def _profile_backend(comm, backend: str, model_choice: str, dtype: str, bs_list: list[int], reps: int) -> str:
    out = []
    for bs, i, rig, batch, graph in host_sections.graph_iterations(comm, backend, model_choice, dtype, bs_list):
        it = graph["iteration"]
        host = []
        for _ in range(reps):
            t0 = time.perf_counter()
            it()
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        dev = statistics.median(Timer(torch.device("cuda")).measure(it, reps, 5))
        _, synced = _runner_calls(rig, batch.inputs, rig.decode_inputs(batch, seed=i), rig.verify_lanes(batch, seed=i), host_copies=False)
        dev_synced = statistics.median(Timer(torch.device("cuda")).measure(synced["iteration"], reps, 5))
        parts = {name: statistics.median(Timer(torch.device("cuda")).measure(graph[name], reps, 5)) for name in ("extend", "decode", "verify")}
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                it()
            torch.cuda.synchronize()
        out.append(f"=== {backend} {model_choice} {dtype} bs {bs}: host {statistics.median(host):.3f} ms/iter (no sync), "
                   f"events {dev:.3f} ms/iter; " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()) + f"; profiled {reps} iterations; "
                   f"inputs without host copies (each fill reads the lengths back: a sync per runner) {dev_synced:.3f} ms/iter")
        out.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
        out.append(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backends", default="torch,triton,flashinfer")
    p.add_argument("--model", default="hd64")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--bs", default="2,8")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--sections", action="store_true", help="host time per section (perf_counter), no profiler")
    a = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    bs_list = [int(b) for b in a.bs.split(",")]
    backends = [b for b in a.backends.split(",") if b in BACKENDS]
    if a.sections:
        host_sections.instrument("flashinfer" in backends)
    measure = host_sections.sections if a.sections else _profile_backend
    for backend in backends:
        world = SimulatedWorld(ParallelLayout(), timeout_s=600)
        print(world.run(lambda comm, b=backend: measure(comm, b, a.model, a.dtype, bs_list, a.reps))[0], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
