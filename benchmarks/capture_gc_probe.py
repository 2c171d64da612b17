"""Probe: does Python's cyclic GC, firing mid-capture, invalidate a CUDA graph capture?

The GPU suite once failed with cudaErrorStreamCaptureInvalidated during a capture that passes
alone. Every graph runner is a reference cycle that owns CUDAGraphs (graph -> body -> runner ->
graphs), so dead runners of earlier tests wait for the cyclic collector, and torch >= 2.5 no
longer gc.collect()s before capture. This script plants such dead cycles and captures with the
collector forced to run during the capture, with and without runners.graph.backend's guard:

  python benchmarks/capture_gc_probe.py [--trials 20] [--json out.json]

Per variant it prints how many of the trials' captures failed and the first error.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from runners.graph.backend import (
    CudaGraph,  # noqa: E402
    GraphBackend,  # noqa: E402
)


class DeadRunner:
    """A stand-in for a dropped graph runner: a cycle that owns captured graphs."""

    def __init__(self, backend: GraphBackend, with_graph: bool):
        self.x = torch.ones(64, 64, device="cuda")  # no RNG: a failed capture leaves the generator mid-capture
        backend.warmup(self.body)  # as the runners do: cuBLAS and the allocator set up outside capture
        self.graphs = [backend.capture(self.body)] if with_graph else []
        self.me = self  # the cycle: only the cyclic collector frees this

    def body(self) -> torch.Tensor:
        return self.x @ self.x


def plant(n: int, with_graph: bool) -> None:
    """Leave n dead cycles in generation 0; the caller keeps the collector from running until the
    capture has begun (threshold 10**9), as a big heap between collections would."""
    gc.collect()
    gc.set_threshold(10**9)
    backend = GraphBackend("cuda", "cuda")
    for _ in range(n):
        DeadRunner(backend, with_graph)


def body() -> torch.Tensor:
    x = torch.full((256, 256), 0.01, device="cuda")
    for _ in range(20):
        x = torch.tanh(x @ x) + 1  # each op makes Python tensor objects: the collector's trigger
    return x


def capture_once(guarded: bool, explicit_collect: bool) -> str | None:
    """Capture `body` once; the collector runs inside the capture (explicitly, or on its own with
    threshold 1, set only once the capture has begun so that nothing is collected before it).
    Returns the error, or None when the capture and a replay succeeded."""
    backend = GraphBackend("cuda", "cuda")
    backend.warmup(body)
    threshold = gc.get_threshold()

    def b():
        if explicit_collect:
            gc.collect()  # the collector runs now, whatever the guard says
        else:
            gc.set_threshold(1)  # the next allocation of a Python object starts a collection, if enabled
        return body()

    try:
        if guarded:
            graph = CudaGraph(b, backend.pool, backend.stream)
            graph.capture()
            graph.replay()
        else:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=backend.pool, stream=backend.stream, capture_error_mode="thread_local"):
                b()
            g.replay()
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # the probe's result: reported, never swallowed
        msg = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        try:
            torch.cuda.synchronize()
        except Exception as exc2:
            msg += f" (then sync: {type(exc2).__name__}: {str(exc2).splitlines()[0]})"
        return msg
    finally:
        gc.set_threshold(*threshold)


VARIANTS = {
    # name: (the dead cycles own graphs, guarded capture, gc.collect() inside the capture)
    "dead graphs, explicit gc.collect() inside capture": (True, False, True),
    "dead tensors only, explicit gc.collect() inside capture": (False, False, True),
    "dead graphs, threshold-1 auto GC, unguarded": (True, False, False),
    "dead graphs, threshold-1 auto GC, guarded (CudaGraph.capture)": (True, True, False),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--dead", type=int, default=4, help="dead cycles planted before each capture")
    ap.add_argument("--variant", type=int, action="append", help="run only these (0-based); default all")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("capture_gc_probe: needs CUDA", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {args.trials} trials, {args.dead} dead cycles each")
    results = {}
    for i, (name, (with_graph, guarded, explicit)) in enumerate(VARIANTS.items()):
        if args.variant and i not in args.variant:
            continue
        errors = []
        for _ in range(args.trials):
            saved = gc.get_threshold()
            try:
                plant(args.dead, with_graph)
                err = capture_once(guarded, explicit)
            finally:
                gc.set_threshold(*saved)
            gc.collect()
            if err:
                errors.append(err)
        results[name] = {"trials": args.trials, "failed": len(errors), "first_error": errors[0] if errors else None}
        print(f"{name:65s} failed {len(errors):3d}/{args.trials}" + (f"   first: {errors[0]}" if errors else ""))
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
