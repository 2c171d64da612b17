"""What the host launches around the graphs of a graphed speculative iteration, counted on CPU.

Every aten op the runner rig's graphed iteration (harness.bench.runners: draft-extend, draft decode,
verify back to back) dispatches outside its graph replays, per runner: the replay fills, the copy-ins,
the output slices. On a GPU each op that is not a view is a kernel launch or a copy the host pays at
every iteration, while a graph's own kernels cost one launch; so this count follows the host side of
`harness bench` where no GPU is at hand. The recorded CPU graph's replay is not counted: it stands for
that one launch. The flashinfer plan (host work with no aten ops) needs a GPU: benchmarks/host_sections.py.

    python benchmarks/host_ops.py [--backends torch,triton] [--model hd64] [--bs 1,2,4,8]
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from typing import Any, Callable
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.bench.command import _model
from harness.bench.runners import RUNNERS, _runner_calls, build_rig, rig_spec
from harness.ranks.simulated import SimulatedWorld
from harness.run.scenario import release
from runners.graph import backend as graph_backend
from runners.parallel.layout import ParallelLayout


class _HostOps(TorchDispatchMode):
    """Counts the ops dispatched while `counting`, split into launches and views (a view launches nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.counting = True
        self.launches: Counter[str] = Counter()
        self.views = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.counting:
            if func.is_view:
                self.views += 1
            else:
                self.launches[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _count(call: Callable[[], Any]) -> _HostOps:
    mode = _HostOps()
    real_replay = graph_backend.GraphBackend.replay

    def replay_uncounted(self: graph_backend.GraphBackend, graph: Any) -> None:
        mode.counting = False
        try:
            real_replay(self, graph)
        finally:
            mode.counting = True

    with mock.patch.object(graph_backend.GraphBackend, "replay", replay_uncounted), mode:
        call()
    return mode


def host_ops(comm, backend: str, model_choice: str, dtype: str, bs_list: list[int]) -> list[str]:
    _, model = _model(model_choice, backend, dtype)
    rig = build_rig(comm, model, rig_spec(tuple(bs_list)), backend, torch.device("cpu"), "sim")
    rows = []
    for i, bs in enumerate(bs_list):
        batch = rig.batch(bs, 1000 * (i + 1))
        _, graph = _runner_calls(rig, batch.inputs, rig.decode_inputs(batch, seed=i), rig.verify_lanes(batch, seed=i))
        graph["iteration"]()  # warm: first-call caches (the triton interpreter's) stay out of the count
        counts = {name: _count(graph[name]) for name in (*RUNNERS, "iteration")}
        cells = [f"{sum(c.launches.values()):>4} / {c.views:<3}" for c in counts.values()]
        top = ", ".join(f"{op} {n}" for op, n in counts["iteration"].launches.most_common(6))
        rows.append(f"{backend:<8} {bs:>3}  " + "  ".join(f"{c:>10}" for c in cells) + f"   {top}")
        release(rig.worker, batch)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="torch,triton")
    p.add_argument("--model", default="hd64")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--bs", default="1,2,4,8")
    args = p.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # a CPU count: triton runs in its interpreter (set before triton's first import)
    bs_list = [int(b) for b in args.bs.split(",")]
    print(f"host ops per graphed iteration outside the graph replays (launches / views), model {args.model}, {args.dtype}, CPU")
    print(f"{'backend':<8} {'bs':>3}  " + "  ".join(f"{n:>10}" for n in (*RUNNERS, "iteration")) + "   most launched (iteration)")
    for backend in args.backends.split(","):
        rows = SimulatedWorld(ParallelLayout()).run(lambda comm, b=backend: host_ops(comm, b, args.model, args.dtype, bs_list))[0]
        print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
