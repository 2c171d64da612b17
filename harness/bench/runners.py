"""The runner rig and `harness bench`'s runner table: draft-extend, draft decode, target verify and
the whole speculative iteration, eager vs graph.

A rig is one world-size-1 rank of a single-layer EAGLE engine: a DraftWorker (one draft layer:
the single-layer draft-extend driver and the EAGLEDraftCudaGraphRunner) and a TargetRunner on the
worker's request map (the DecodeCudaGraphRunner), its requests written by
harness.run.scenario.materialize. Each runner gets the inputs it gets in the loop for the same
requests: the draft-extend the materialized batch; the draft decode a top-k and hidden state per
request, its lanes starting at the prefix end (its topk * (num_steps - 1) draft slots lie inside
the request's prefix + T slots); the verify T tokens per request at the prefix end. The inputs
are not chained through a scheduler (no acceptance, no host work between the runners), so the
iteration timed is the three runners back to back: the part a CUDA graph can speed up.
tests/test_gpu_runners.py drives the same rig for P1 / P3 and the CPU-vs-GPU comparison.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from harness.run.scenario import Iteration, MaterializedBatch, RequestSpec, Scenario, materialize, release
from runners.config import ModelConfig, SpecConfig
from runners.decode_cuda_graph_runner import DecodeCudaGraphRunner, VerifyInputs, verify_inputs
from runners.draft_extend import DraftWorker, run_eager
from runners.draft_extend_graph_driver import DraftExtendGraphDriver
from runners.eagle_draft import DraftDecodeInputs, run_eager_decode
from runners.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
from runners.graph.backend import GraphBackend
from runners.parallel.dp_attention import RankContext
from runners.parallel.layout import ParallelLayout
from runners.target import Lane, TargetRunner

RUNNERS = ("extend", "decode", "verify")
PREFIX = 24  # prefix tokens per request; + T stays inside max_context_len (64) for num_steps <= 7


def rig_spec(bs_list: tuple[int, ...], topk: int = 1, num_steps: int = 3) -> SpecConfig:
    return SpecConfig(num_steps=num_steps, topk=topk, capture_bs=tuple(bs_list), max_running_requests=max(bs_list), draft="single_layer")


@dataclass
class RunnerRig:
    worker: DraftWorker
    target: TargetRunner
    extend: Optional[DraftExtendGraphDriver]  # None: not built (a test that needs only some runners skips their captures)
    decode: Optional[EAGLEDraftCudaGraphRunner]
    verify: Optional[DecodeCudaGraphRunner]
    scenario_of: Callable[[int, int], Scenario]

    def batch(self, bs: int, base_rid: int) -> MaterializedBatch:
        sc = self.scenario_of(bs, base_rid)
        return materialize(self.worker, sc, sc.iterations[0])

    def decode_inputs(self, batch: MaterializedBatch, seed: int) -> DraftDecodeInputs:
        """The draft-extend's outputs as the draft decode reads them, drawn on CPU from `seed` (same on every device)."""
        w, inp = self.worker, batch.inputs
        k, bs, dev = w.spec.topk, inp.bs, w.device
        g = torch.Generator().manual_seed(seed)
        seq = inp.seq_lens - w.spec.num_tokens_per_bs  # the KV-ready prefix
        seq_cpu = inp.seq_lens_cpu - w.spec.num_tokens_per_bs  # its host copy, as the scheduler keeps it
        p = torch.rand(bs, k, generator=g).sort(dim=1, descending=True).values
        ids = torch.randint(0, w.cfg.vocab_size, (bs, k), generator=g)
        hid = torch.randn(bs, w.cfg.hidden_size, generator=g).to(w.cfg.torch_dtype)
        return DraftDecodeInputs(p.to(dev), ids.to(dev), hid.to(dev), seq, inp.req_pool_indices, seq.repeat_interleave(k), [bs], seq_cpu)

    def verify_lanes(self, batch: MaterializedBatch, seed: int) -> list[Lane]:
        T = self.worker.spec.num_tokens_per_bs
        g = torch.Generator().manual_seed(seed)
        rows, seqs = batch.inputs.req_pool_indices.tolist(), batch.inputs.seq_lens.tolist()
        return [Lane(r, s - T, torch.randint(0, self.worker.cfg.vocab_size, (T,), generator=g).tolist()) for r, s in zip(rows, seqs, strict=True)]

    def verify_inputs(self, lanes: list[Lane]) -> VerifyInputs:
        return verify_inputs(lanes, [len(lanes)], self.worker.device)

    def eager_decode(self, inp: DraftDecodeInputs):
        return run_eager_decode(self.worker, inp)  # the worker's backend: the one its graph runner captured

    def eager_verify(self, lanes: list[Lane]):
        return self.target.forward_synced(lanes, [len(lanes) * self.worker.spec.num_tokens_per_bs])


def build_rig(comm, model: ModelConfig, spec: SpecConfig, backend: str, device: torch.device, graph_kind: str,
              layout: ParallelLayout | None = None, seed: int = 0, runners: tuple[str, ...] = RUNNERS) -> RunnerRig:
    """Build and capture the graph runners named in `runners` of one world-size-1 rank (call inside a SimulatedWorld)."""
    layout = layout or ParallelLayout()
    ctx = RankContext(layout, 0, comm)
    T = spec.num_tokens_per_bs
    max_bs = max(spec.capture_bs)
    slots = 1 + 2 * max_bs * (PREFIX + T) + 64
    worker = DraftWorker(ctx, model, spec, num_layers=1, attention_backend=backend, device=device, max_reqs=2 * max_bs + 4, num_slots=slots)
    target = TargetRunner(ctx, model, worker.req_pool, slots, worker.device, backend, spec.page_size)
    g = torch.Generator().manual_seed(seed + 17)
    for t in target.kv_pool.k + target.kv_pool.v:  # the target's prefix KV: materialize writes the draft's only
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))

    def scenario_of(bs: int, base_rid: int) -> Scenario:
        reqs = tuple(RequestSpec(base_rid + i, PREFIX, 1 + (7 * i + 3) % T) for i in range(bs))
        return Scenario(model, spec, layout, (Iteration((reqs,)),), seed=seed, attention_backend=backend, name=f"rig-bs{bs}")

    graphs = GraphBackend(graph_kind, worker.device)  # one graph pool for the rank's runners, as runners.spec_decode
    extend = DraftExtendGraphDriver(worker, graphs.sibling(), single_layer=True) if "extend" in runners else None
    decode = EAGLEDraftCudaGraphRunner(worker, graphs.sibling()) if "decode" in runners else None
    verify = DecodeCudaGraphRunner(ctx, model, spec, target, graphs.sibling(), worker.device) if "verify" in runners else None
    for r in (verify, extend, decode):  # the target's graphs first, as the engine captures them
        if r is not None:
            r.capture()
    return RunnerRig(worker, target, extend, decode, verify, scenario_of)


def _runner_calls(rig: RunnerRig, ext, dec: DraftDecodeInputs, lanes: list[Lane], host_copies: bool = True) -> tuple[dict, dict]:
    """Eager and graph calls per runner, and the iteration (the three back to back). host_copies=False drops the
    inputs' host lengths (and verify mask), so every graph runner's fill reads them back from the device (a sync each)."""
    ver = rig.verify_inputs(lanes)
    if not host_copies:
        ext, dec = replace(ext, seq_lens_cpu=None), replace(dec, seq_lens_cpu=None)
        ver = replace(ver, seq_lens_cpu=None, custom_mask_cpu=None)
    eager = {"extend": lambda: run_eager(rig.worker, ext), "decode": lambda: rig.eager_decode(dec), "verify": lambda: rig.eager_verify(lanes)}
    graph = {"extend": lambda: rig.extend.run(ext), "decode": lambda: rig.decode.replay(dec), "verify": lambda: rig.verify.replay(ver)}
    for calls in (eager, graph):
        parts = [calls["extend"], calls["decode"], calls["verify"]]
        calls["iteration"] = lambda parts=parts: [f() for f in parts]
    return eager, graph


def bench_runners_backend(comm, backend: str, args, device: torch.device, bs_list: list[int], model_of, timer_cls) -> dict:
    """Per batch size (each a capture bucket): every runner eager vs graph (replays unobserved, as an engine runs them)."""
    model_name, model = model_of(args.model, backend, args.dtype)
    spec = rig_spec(tuple(bs_list), num_steps=args.num_steps)
    gkind = args.graph if args.graph != "auto" else ("cuda" if device.type == "cuda" else "sim")
    rig = build_rig(comm, model, spec, backend, device, gkind)
    timer = timer_cls(device)
    rows = []
    for i, bs in enumerate(bs_list):
        batch = rig.batch(bs, 1000 * (i + 1))
        eager, graph = _runner_calls(rig, batch.inputs, rig.decode_inputs(batch, seed=i), rig.verify_lanes(batch, seed=i))
        row = {"backend": backend, "bs": bs}
        for name in ("extend", "decode", "verify", "iteration"):
            e, gr = map(statistics.median, timer.measure_interleaved([eager[name], graph[name]], args.replays, args.warmup))
            row.update({f"{name}_eager_ms": e, f"{name}_graph_ms": gr, f"{name}_speedup": e / gr})
        release(rig.worker, batch)
        rows.append(row)
    return {"backend": backend, "model": model_name, "dtype": args.dtype, "graph_kind": gkind, "tokens_per_bs": spec.num_tokens_per_bs,
            "rows": rows}


def format_runner_table(results: list[dict], meta: dict) -> str:
    lines = [f"harness bench: every runner, single-layer EAGLE, TP1, {meta['dtype']}, {meta['num_steps']} steps, {meta['date']}, {meta['device']}",
             "eager vs graph, median ms (measured in alternating blocks); "
             "iteration = draft-extend + draft decode + verify back to back (no scheduler host work); "
             "every runner attends with the row's backend"]
    hdr = f"{'backend':<10} {'bs':>3}" + "".join(f" {n:>22}" for n in ("extend e/g (x)", "decode e/g (x)", "verify e/g (x)", "iteration e/g (x)"))
    for b in results:
        lines += ["", f"[{b['backend']}] model {b['model']}, T={b['tokens_per_bs']}, graphs: {b['graph_kind']}", hdr]
        for r in b["rows"]:
            cells = "".join(f" {r[f'{n}_eager_ms']:>7.3f}/{r[f'{n}_graph_ms']:<7.3f}({r[f'{n}_speedup']:>4.1f})"
                            for n in ("extend", "decode", "verify", "iteration"))
            lines.append(f"{b['backend']:<10} {r['bs']:>3}{cells}")
    return "\n".join(lines)
