"""Where a graphed speculative iteration spends its host time: torch.profiler over the runner rig's
graph iteration (draft-extend, draft decode, verify back to back, no P1 records), per backend.

    python benchmarks/profile_iter.py [--backends torch,triton,flashinfer] [--model hd64] [--bs 2,8] > profile.txt

Per backend and batch size: the host time of one iteration (perf_counter around the calls,
no sync) against its device time (CUDA events), then the profiler's ops by self CPU time.
A device sync inside the iteration shows as a cudaStreamSynchronize / aten::item / _local_scalar_dense row.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from harness.bench import _model, _Timer
from harness.bench_runners import _runner_calls, build_rig, rig_spec
from harness.ranks.simulated import SimulatedWorld
from harness.scenario import release
from runners.parallel.layout import ParallelLayout


def _profile_backend(comm, backend: str, model_choice: str, dtype: str, bs_list: list[int], reps: int) -> str:
    _, model = _model(model_choice, backend, dtype)
    rig = build_rig(comm, model, rig_spec(tuple(bs_list)), backend, torch.device("cuda"), "cuda")
    rig.extend.record = False
    out = []
    for i, bs in enumerate(bs_list):
        batch = rig.batch(bs, 1000 * (i + 1))
        _, graph = _runner_calls(rig, batch.inputs, rig.decode_inputs(batch, seed=i), rig.verify_lanes(batch, seed=i))
        it = graph["iteration"]
        for _ in range(5):
            it()
        torch.cuda.synchronize()
        host = []
        for _ in range(reps):
            t0 = time.perf_counter()
            it()
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        dev = statistics.median(_Timer(torch.device("cuda")).measure(it, reps, 5))
        _, synced = _runner_calls(rig, batch.inputs, rig.decode_inputs(batch, seed=i), rig.verify_lanes(batch, seed=i), host_copies=False)
        dev_synced = statistics.median(_Timer(torch.device("cuda")).measure(synced["iteration"], reps, 5))
        parts = {name: statistics.median(_Timer(torch.device("cuda")).measure(graph[name], reps, 5)) for name in ("extend", "decode", "verify")}
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                it()
            torch.cuda.synchronize()
        out.append(f"=== {backend} {model_choice} {dtype} bs {bs}: host {statistics.median(host):.3f} ms/iter (no sync), "
                   f"events {dev:.3f} ms/iter; " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()) + f"; profiled {reps} iterations; "
                   f"inputs without host copies (each fill reads the lengths back: a sync per runner) {dev_synced:.3f} ms/iter")
        out.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
        out.append(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
        release(rig.worker, batch)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backends", default="torch,triton,flashinfer")
    p.add_argument("--model", default="hd64")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--bs", default="2,8")
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args(argv)
    from runners.attention import BACKENDS

    torch.backends.cuda.matmul.allow_tf32 = False
    bs_list = [int(b) for b in a.bs.split(",")]
    for backend in (b for b in a.backends.split(",") if b in BACKENDS):
        world = SimulatedWorld(ParallelLayout(), timeout_s=600)
        print(world.run(lambda comm, b=backend: _profile_backend(comm, b, a.model, a.dtype, bs_list, a.reps))[0], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
