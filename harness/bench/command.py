"""`harness bench`: draft-extend step time, eager vs graph replay, per attention backend.

For each backend and batch size (every size is a capture bucket, so raw_bs == bucket and
no lane is padded) it times, after warm-up, repetitions (min, median and max reported) of
- step: one draft-extend step (draft layer 0): `draft_extend_step` eagerly with the live
  batch's metadata, against one graph replay of the bucket (for flashinfer plus the host
  plan that the first step of an iteration needs: `plan_replay`; the later steps reuse it);
- iter: a whole draft-extend iteration (every draft layer, with the runner's copy-in,
  replay fill and slicing): `run_eager` against `DraftExtendGraphDriver.run`;
and the capture time of every bucket (warm-ups included), after one eager step has
compiled the backend's kernels. On a GPU each repetition is timed with a pair of CUDA
events; on CPU with perf_counter, and the "graph" there is the recorded CPU graph (a replay
re-issues the ops recorded at capture, no Python of the body): the table says so in its
header, and gives the number of recorded ops per captured graph.

Also reported, per row: max |graph - eager| over the step's logits, so a fast graph that
computes something else shows. On a GPU the default is >= 50 repetitions of seven batch sizes; on
CPU (a simulation whose numbers are no GPU's) a short run of two sizes and 15 repetitions, with
progress per batch size and a warning when other processes load the CPU (the spread shows it too).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, replace
from typing import Callable, Optional

import torch

from harness.bench.runners import bench_runners_backend, format_runner_table
from harness.bench.timer import INTERLEAVE_BLOCKS, Timer, load_warning, spread
from harness.ranks.simulated import SimulatedWorld
from harness.run.observe import observe_all
from harness.run.scenario import Iteration, RequestSpec, Scenario, materialize, release

DEFAULT_BS = (1, 2, 4, 8, 16, 32, 64)
CPU_BS = (1, 8)  # CPU: seconds, not minutes (the recorded graph's replay cost grows with bs as eager's does)
REPLAYS = {"cuda": 50, "cpu": 15}  # default repetitions per measurement
MIN_REPLAYS = {"cuda": 50, "cpu": 10}  # fewer only with --quick
PREFIX_LEN = 32

# "default" is the harness' model (hidden 64, 8 heads of dim 8: launch-bound on any GPU);
# flashinfer has no kernels for head_dim 8, so "auto" gives it "hd64" (same depth, head_dim 64).
MODEL_CHOICES = ("auto", "default", "hd64")


def _model(choice: str, backend: str, dtype: str):
    from runners.config import ModelConfig

    if choice == "auto":
        choice = "hd64" if backend == "flashinfer" else "default"
    base = ModelConfig() if choice == "default" else ModelConfig(hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=1024)
    return choice, replace(base, dtype=dtype)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="draft-extend step time: eager vs graph replay, per attention backend and batch size",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backend", default="auto",
                   help="comma-separated torch,triton,flashinfer; 'all' for every registered one; 'auto' (default): all on a GPU, torch on CPU")
    p.add_argument("--bs", default=None, help=f"comma-separated batch sizes (each is a capture bucket); default {','.join(map(str, DEFAULT_BS))} "
                                             f"on a GPU, {','.join(map(str, CPU_BS))} on CPU")
    p.add_argument("--replays", type=int, default=None,
                   help=f"timed repetitions per measurement (min, median, max reported); default {REPLAYS['cuda']} on a GPU "
                        f"(at least {MIN_REPLAYS['cuda']} unless --quick), {REPLAYS['cpu']} on CPU (at least {MIN_REPLAYS['cpu']})")
    p.add_argument("--warmup", type=int, default=5, help="untimed repetitions before timing")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the results as JSON to PATH (the table still prints), or to stdout instead of the table with no PATH")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--num-steps", type=int, default=3, help="draft layers (speculative steps); T = num_steps + 1 tokens per request")
    p.add_argument("--model", default="auto", choices=MODEL_CHOICES, help="auto: default for torch/triton, hd64 for flashinfer")
    p.add_argument("--graph", default="auto", choices=("auto", "sim", "cuda"), help="graph backend; auto: cuda on a GPU, sim on CPU")
    p.add_argument("--quick", action="store_true", help="allow fewer --replays than the minimum (smoke tests)")
    p.add_argument("--runners", default="auto", choices=("auto", "on", "off"),
                   help="also time every runner (draft-extend, draft decode, verify) and the iteration (harness.bench.runners); auto: on a GPU")
    p.set_defaults(func=main)


def _backends(arg: str, device: torch.device) -> list[str]:
    from runners.attention import BACKENDS, unavailable_reason

    if arg == "auto":
        return [b for b in ("torch", "triton", "flashinfer") if b in BACKENDS] if device.type == "cuda" else ["torch"]
    if arg == "all":
        return [b for b in ("torch", "triton", "flashinfer") if b in BACKENDS]
    names = [b.strip() for b in arg.split(",") if b.strip()]
    for b in names:
        if b not in BACKENDS:
            raise SystemExit(f"error: --backend {b}: {unavailable_reason(b)}")
    return names


def _bench_backend(comm, backend: str, args, device: torch.device, bs_list: list[int], progress: Callable[[str], None] = print) -> dict:
    from runners.config import SpecConfig
    from runners.draft_extend import DraftWorker, draft_extend_step, eager_forward_batch, run_eager
    from runners.draft_extend_graph_driver import DraftExtendGraphDriver
    from runners.graph.backend import GraphBackend
    from runners.parallel.dp_attention import RankContext
    from runners.parallel.layout import ParallelLayout

    model_name, model = _model(args.model, backend, args.dtype)
    spec = SpecConfig(num_steps=args.num_steps, capture_bs=tuple(bs_list), max_running_requests=max(bs_list))
    T = spec.num_tokens_per_bs
    prefix = min(PREFIX_LEN, model.max_context_len - T)
    layout = ParallelLayout()
    ctx = RankContext(layout, 0, comm)
    slots = 1 + 2 * max(bs_list) * (prefix + T) + 64
    worker = DraftWorker(ctx, model, spec, attention_backend=backend, device=device, max_reqs=2 * max(bs_list) + 4, num_slots=slots)
    gkind = args.graph if args.graph != "auto" else ("cuda" if device.type == "cuda" else "sim")
    gb = GraphBackend(gkind, device)
    timer = Timer(device)

    def scenario(bs: int, base_rid: int) -> Scenario:
        reqs = tuple(RequestSpec(base_rid + i, prefix, 1 + (7 * i + 3) % T) for i in range(bs))
        return Scenario(model, spec, layout, (Iteration((reqs,)),), seed=0, attention_backend=backend, name=f"bench-bs{bs}")

    # compile the backend's kernels (triton JIT, flashinfer JIT) before anything is timed
    t0 = time.perf_counter()
    sc = scenario(1, 10_000)
    batch = materialize(worker, sc, sc.iterations[0])
    run_eager(worker, batch.inputs)
    timer.sync()
    release(worker, batch)
    first_run_s = time.perf_counter() - t0

    driver = DraftExtendGraphDriver(worker, gb)
    ends: list[float] = []
    real_capture = gb.capture

    def timed_capture(body, **kw):
        g = real_capture(body, **kw)
        timer.sync()
        ends.append(time.perf_counter())
        return g

    gb.capture = timed_capture
    t0 = time.perf_counter()
    driver.capture()
    timer.sync()
    capture_s = time.perf_counter() - t0
    gb.capture = real_capture
    order = [bs for r in driver.runners for bs in reversed(r.capture_bs)]
    graph_ops = [{str(bs): g.num_ops for bs, g in sorted(r.graphs.items())} for r in driver.runners] if gkind == "sim" else None
    per_bucket: dict[int, float] = {}
    prev = t0
    for bs, end in zip(order, ends, strict=True):
        per_bucket[bs] = per_bucket.get(bs, 0.0) + (end - prev)
        prev = end

    rows = []
    for i, bs in enumerate(bs_list):
        sc = scenario(bs, 1000 * (i + 1))
        batch = materialize(worker, sc, sc.iterations[0])
        inp = batch.inputs
        fb = eager_forward_batch(worker, inp, inp.input_ids, inp.hidden_states)
        eager_step = timer.measure(lambda fb=fb: draft_extend_step(worker, 0, fb), args.replays, args.warmup)
        eager_out = draft_extend_step(worker, 0, fb)

        runner = driver.runners[0]
        bucket = runner.prepare_replay(inp)
        graph = runner.graphs[bucket]
        replan = getattr(worker.attn, "plan_replay", None)
        cap_fb = runner.capture_batches[bucket]

        def replay_step(graph=graph, cap_fb=cap_fb, replan=replan):
            if replan is not None:
                replan(cap_fb)
            gb.replay(graph)

        graph_step = timer.measure(replay_step, args.replays, args.warmup)
        # where a plan precedes the replay (flashinfer), the replay alone too: the plan is host work
        replay_only = timer.measure(lambda graph=graph: gb.replay(graph), args.replays, args.warmup) if replan is not None else None
        replay_step()
        timer.sync()
        n = bs * T
        diff = float((graph.output.logits[:n].float() - eager_out.logits[:n].float()).abs().max())

        eager_iter, graph_iter = timer.measure_interleaved(  # the graph as an engine runs it
            [lambda inp=inp: run_eager(worker, inp), lambda inp=inp: driver.run(inp)], args.replays, args.warmup)
        observers = observe_all(driver.runners)  # as the harness runs it: plus P1's ReplayRecords (host read-backs)
        graph_iter_rec = timer.measure(lambda inp=inp, first=observers[0]: (driver.run(inp), first.take()), args.replays, args.warmup)
        for obs in reversed(observers):
            obs.detach()
        release(worker, batch)
        med = statistics.median
        rows.append({
            "backend": backend, "bs": bs, "tokens": n,
            "eager_step_ms": med(eager_step), "graph_step_ms": med(graph_step), "step_speedup": med(eager_step) / med(graph_step),
            "eager_iter_ms": med(eager_iter), "graph_iter_ms": med(graph_iter), "iter_speedup": med(eager_iter) / med(graph_iter),
            "graph_iter_recorded_ms": med(graph_iter_rec),
            "graph_replay_only_ms": None if replay_only is None else med(replay_only),
            "eager_step_min_ms": min(eager_step), "graph_step_min_ms": min(graph_step),
            "spread_ms": {"eager_step": spread(eager_step), "graph_step": spread(graph_step), "eager_iter": spread(eager_iter),
                          "graph_iter": spread(graph_iter)},
            "max_abs_diff_logits": diff, "replays": args.replays,
        })
        r = rows[-1]
        progress(f"[{backend}] bs {bs} ({i + 1}/{len(bs_list)}): step eager {r['eager_step_ms']:.3f}ms graph {r['graph_step_ms']:.3f}ms, "
                 f"iter eager {r['eager_iter_ms']:.3f}ms graph {r['graph_iter_ms']:.3f}ms")
    return {
        "backend": backend, "model": model_name, "model_config": asdict(model), "tokens_per_bs": T, "graph_kind": gkind,
        "first_eager_run_s": first_run_s,
        "capture": {"seconds_total": capture_s, "graphs": len(order), "per_bucket_s": {str(k): v for k, v in sorted(per_bucket.items())}},
        "graph_stats": asdict(gb.stats), "graph_ops": graph_ops, "rows": rows,
    }


def _versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("triton", "flashinfer"):
        try:
            from importlib.metadata import version

            out[pkg] = version(pkg if pkg != "flashinfer" else "flashinfer-python")
        except Exception:  # noqa: BLE001 - not installed
            out[pkg] = None
    return out


def _defaults(args, device: torch.device) -> tuple[list[int], int]:
    """The batch sizes and repetitions: as given, else the device's defaults (a short run on CPU)."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    replays = REPLAYS[kind] if args.replays is None else args.replays
    if replays < MIN_REPLAYS[kind] and not args.quick:
        raise SystemExit(f"error: --replays must be >= {MIN_REPLAYS[kind]} on {kind} (min, median and max of that many); pass --quick for a smoke run")
    text = args.bs if args.bs is not None else ",".join(map(str, DEFAULT_BS if kind == "cuda" else CPU_BS))
    try:
        bs_list = sorted({int(b) for b in str(text).split(",") if b.strip()})
    except ValueError:
        raise SystemExit(f"error: --bs {text}: comma-separated integers (e.g. 1,4,16)") from None
    if not bs_list or bs_list[0] < 1:
        raise SystemExit("error: --bs needs batch sizes >= 1")
    return bs_list, replays


def run_bench(args, progress: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True)) -> dict:
    from runners.parallel.layout import ParallelLayout

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: torch.cuda.is_available() is False")
    bs_list, args.replays = _defaults(args, device)
    backends = _backends(args.backend, device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    warnings = [w for w in [load_warning(device)] if w]
    for w in warnings:
        progress(w)
    progress(f"harness bench: {', '.join(backends)} on {device.type}, bs {','.join(map(str, bs_list))}, {args.replays} repetitions each")
    t0 = time.perf_counter()
    results = []
    for backend in backends:
        world = SimulatedWorld(ParallelLayout(), timeout_s=3600)
        results.append(world.run(lambda comm, b=backend: _bench_backend(comm, b, args, device, bs_list,
                                                                        lambda m: progress(f"{m}, {time.perf_counter() - t0:.0f}s elapsed")))[0])
    runners = []
    if args.runners == "on" or (args.runners == "auto" and device.type == "cuda"):
        if args.num_steps < 2:
            raise SystemExit("error: --runners needs --num-steps >= 2 (the draft decode runs num_steps - 1 forwards)")
        for backend in backends:
            progress(f"[{backend}] every runner, eager vs graph, bs {','.join(map(str, bs_list))}")
            world = SimulatedWorld(ParallelLayout(), timeout_s=3600)
            runners.append(world.run(lambda comm, b=backend: bench_runners_backend(comm, b, args, device, bs_list, _model, Timer))[0])
    late = load_warning(device)  # the load of the run's last minute, which the first check could not see
    if late and not warnings:
        warnings.append(late)
        progress(late)
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()}, "
                                                                                     f"{torch.get_num_threads()} threads)",
        "device_type": device.type,
        "simulation": device.type != "cuda" or args.graph == "sim",
        "dtype": args.dtype, "num_steps": args.num_steps, "layout": "tp1", "replays": args.replays, "warmup": args.warmup,
        "timing": "CUDA events, per repetition" if device.type == "cuda" else "perf_counter, per repetition",
        "versions": _versions(), "warnings": warnings,
    }
    return {"meta": meta, "backends": results, "runners": runners}


def format_table(res: dict) -> str:
    m = res["meta"]
    lines = []
    kind = ("CPU SIMULATION: 'graph' replays the ops recorded at capture (no CUDA graph, no Python of the body); the numbers are not GPU numbers"
            if m["simulation"] else "real CUDA graphs (torch.cuda.CUDAGraph replay)")
    lines.append(f"harness bench: draft-extend, TP1, {m['dtype']}, {m['num_steps']} draft layers, {m['date']}")
    lines.append(f"device: {m['device']}; {kind}")
    lines.append(f"timing: {m['timing']}, median [min-max] of {m['replays']} after {m['warmup']} warm-up (ms); step = draft layer 0; iter = all layers + "
                 f"copy-in/fill/slice, as an engine runs it, eager and graph in {INTERLEAVE_BLOCKS} alternating blocks "
                 "(+rec: with the harness's P1 replay records, host read-backs included); speedup: of the medians")
    lines += m.get("warnings", [])
    hdr = (f"{'backend':<10} {'bs':>3} {'eager step':>25} {'graph step':>25} {'speedup':>8} {'eager iter':>25} {'graph iter':>25} {'speedup':>8} "
           f"{'+rec iter':>9} {'max|diff|':>10}")
    for b in res["backends"]:
        mc = b["model_config"]
        lines.append("")
        lines.append(f"[{b['backend']}] model {b['model']} (hidden {mc['hidden_size']}, heads {mc['num_heads']}/{mc['num_kv_heads']}, "
                     f"head_dim {mc['hidden_size'] // mc['num_heads']}, vocab {mc['vocab_size']}), T={b['tokens_per_bs']}, graphs: {b['graph_kind']}")
        lines.append(hdr)
        for r in b["rows"]:
            cell = lambda k, sp=r["spread_ms"]: f"{sp[k]['median']:.3f} [{sp[k]['min']:.3f}-{sp[k]['max']:.3f}]"  # noqa: E731
            lines.append(f"{r['backend']:<10} {r['bs']:>3} {cell('eager_step'):>25} {cell('graph_step'):>25} {r['step_speedup']:>7.2f}x "
                         f"{cell('eager_iter'):>25} {cell('graph_iter'):>25} {r['iter_speedup']:>7.2f}x "
                         f"{r['graph_iter_recorded_ms']:>9.3f} {r['max_abs_diff_logits']:>10.2e}")
        only = [f"bs {r['bs']}: {r['graph_replay_only_ms']:.3f}ms" for r in b["rows"] if r.get("graph_replay_only_ms") is not None]
        if only:
            lines.append(f"graph step includes the host plan of an iteration's first step; the replay alone: {', '.join(only)}")
        if b.get("graph_ops"):
            ops = "; ".join(f"layer {k}: " + ", ".join(f"bs {bs} {n}" for bs, n in layer.items()) for k, layer in enumerate(b["graph_ops"]))
            lines.append(f"recorded ops per graph: {ops}")
        c = b["capture"]
        per = ", ".join(f"{k}: {v:.2f}s" for k, v in c["per_bucket_s"].items())
        lines.append(f"capture: {c['graphs']} graphs ({len(c['per_bucket_s'])} buckets x {b['graph_stats']['captures'] // max(len(c['per_bucket_s']), 1)} "
                     f"layers) in {c['seconds_total']:.2f}s; per bucket (warm-ups included): {per}; first eager run (kernel compile) "
                     f"{b['first_eager_run_s']:.2f}s")
    return "\n".join(lines)


def main(args) -> int:
    res = run_bench(args)
    if args.json == "-":
        print(json.dumps(res, indent=2))
        return 0
    print(format_table(res), flush=True)
    if res["runners"]:
        print("\n" + format_runner_table(res["runners"], res["meta"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def standalone(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="harness")
    sub = p.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = p.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)

