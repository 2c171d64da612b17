"""`harness engine-check --engine vllm[==VERSION] [--json] [--install]`: our invariants on vLLM's EAGLE proposer.

One line per (DP size, runner, bucket), the invariants that do not apply to vLLM's design with
their reason, then a verdict. Exit 0: every check held; 1: a check failed; 2: the release could
not be checked (not installed, or the adapter cannot drive it: the message says what moved);
3: the release predates the path or a capture API the adapter speaks (n/a, with the reason).
"""
from __future__ import annotations

import functools
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, Optional

from harness.engines.drive import BaselineFiles, cannot_check, drive_engine
from harness.engines.guard import guarded
from harness.engines.install import EngineSpec, InstallError, deps_dir, engines_root, release_dir
from harness.engines.options import EVERYTHING, Selection
from harness.engines.sglang.errors import EngineAdapterError, MissingEngineAttribute
from harness.engines.vllm.checks import NOT_APPLICABLE, check_capture, check_iteration, line_for
from harness.engines.vllm.config import VllmCheckConfig
from harness.engines.vllm.drive import DECODE_RUNNERS, DECODE_RUNS, RUNNERS, decode_paths, drive_world
from harness.engines.vllm.install import ensure_vllm_installed, installed_vllm_versions, vllm_deps_dir, vllm_dir
from harness.engines.vllm.loader import VllmEngine, load
from harness.engines.vllm.report import VllmReport, format_report
from harness.ranks.simulated import one_torch_thread


@one_torch_thread()  # tiny tensors: torch's intra-op pool only spins (harness/ranks/simulated.py)
def check_vllm(engine: VllmEngine, cfg: Optional[VllmCheckConfig] = None, progress: Optional[Callable[[str], None]] = None,
               selection: Selection = EVERYTHING) -> VllmReport:
    cfg = cfg or VllmCheckConfig()
    t0 = time.perf_counter()
    lines: dict = {}
    paths = decode_paths(engine)
    not_applicable = list(NOT_APPLICABLE)
    if any(f not in paths for f in cfg.fused_decode):
        not_applicable.append(f"{DECODE_RUNNERS[1]}: n/a: vllm {engine.version}'s speculator has no fused multi-step draft decode "
                              f"(none of {', '.join(DECODE_RUNS[1])}): every draft step replays its own graph ({DECODE_RUNNERS[0]})")
    for world_cfg, fused, dp, all_runners in worlds(replace(cfg, fused_decode=tuple(f for f in cfg.fused_decode if f in paths))):
        runners = [r for r in all_runners if selection.wants(r)]
        if not runners:  # a world drives its runners together: one none of whose runners is selected is not driven
            continue
        if progress:
            progress(f"dp={dp} K={world_cfg.num_speculative_tokens} {DECODE_RUNNERS[fused]}")
        w = {"dp": dp, "runner": runners[0], "K": world_cfg.num_speculative_tokens}
        preflight = not lines
        # every call into the engine is guarded (harness/engines/guard.py): a world that raises is a finding of its first runner's
        # capture line; the first world driven is the pre-flight (no check has run yet), where an adapter error means the
        # adapter cannot drive this release (exit 2)
        driven = guarded(line_for(lines, dp, runners[0], None).verdict, f"driving the dp={dp} world ({DECODE_RUNNERS[fused]})", w,
                         lambda world_cfg=world_cfg, dp=dp, fused=fused: drive_world(engine, world_cfg, dp, fused), engine.location,
                         (EngineAdapterError, MissingEngineAttribute) if preflight else ())
        if driven is None:
            continue
        caps, replays, ranks = driven
        guarded(line_for(lines, dp, runners[0], None).verdict, "the checks of its records", w,
                functools.partial(_check_world, lines, runners, caps, replays, ranks, world_cfg, dp, engine), engine.location)
    ordered = sorted(lines.values(), key=lambda ln: (ln.dp, RUNNERS.index(ln.runner), ln.bucket != "capture", _bucket_key(ln.bucket)))
    rep = VllmReport(engine.version, engine.location, asdict(cfg), ordered, not_applicable, engine.stubbed, time.perf_counter() - t0,
                     engine.api.name, engine.api.flags(cfg), selection.left_out(RUNNERS))
    rep.order_failures()
    return rep


def _check_world(lines: dict, runners: list[str], caps: list, replays: list, ranks: list, world_cfg: VllmCheckConfig, dp: int,
                 engine: VllmEngine) -> None:
    for runner in runners:
        for rank, cap in enumerate(caps):
            check_capture(line_for(lines, dp, runner, None), runner, cap, world_cfg, dp, rank, engine.api, ranks[rank].vcfg)
    seen: dict = {}
    by_iter: dict[tuple[int, str], list] = {}
    for r in replays:
        if r.rec.runner in runners:
            by_iter.setdefault((r.iteration, r.rec.runner), []).append(r)
    for (_, _), reps in sorted(by_iter.items(), key=lambda kv: (kv[0][0], RUNNERS.index(kv[0][1]))):
        check_iteration(lines, seen, reps, caps, world_cfg, dp, engine.api.dispatch)


def worlds(cfg: VllmCheckConfig) -> list[tuple[VllmCheckConfig, bool, int, list[str]]]:
    """(configuration, decode path, DP size, runners checked) of each world driven. At cfg's K: the target and the draft
    prefill (they run alike whichever decode path follows) with the first path's decode; at the decode worlds' K, where
    that differs: each decode path's steps."""
    first = cfg.fused_decode[0]
    out = [(cfg, first, dp, [r for r in RUNNERS if r not in DECODE_RUNNERS or r == DECODE_RUNNERS[first]]) for dp in cfg.dp_sizes]
    steps = replace(cfg, num_speculative_tokens=cfg.decode_num_speculative_tokens)
    for fused in cfg.fused_decode:
        if steps != cfg or fused != first:
            out += [(steps, fused, dp, [DECODE_RUNNERS[fused]]) for dp in cfg.decode_dp_sizes]
    return out


def _bucket_key(bucket: str) -> int:
    return int(bucket.split()[0].split("=")[1]) if bucket.startswith("reqs=") else 10**9


def _resolve(spec: EngineSpec, args) -> Path:
    if args.target:
        return Path(args.target)
    if spec.version is not None:
        return release_dir(spec, vllm_dir(spec.version), args.install, ensure_vllm_installed, "pass --install")
    versions = installed_vllm_versions()
    if not versions:
        raise FileNotFoundError(f"no vllm under {engines_root()}: give --engine vllm==VERSION --install")
    return vllm_dir(versions[-1])


def main(args, selection: Selection = EVERYTHING) -> int:
    try:
        spec = EngineSpec.parse(args.engine)
        target = _resolve(spec, args)
    except (FileNotFoundError, ValueError, InstallError) as e:
        return cannot_check(str(e), args.json)
    deps = [Path(args.deps)] if args.deps else [deps_dir(), vllm_deps_dir()]
    return drive_engine(spec, lambda: load(target, deps),
                        lambda engine, progress: check_vllm(engine, VllmCheckConfig(), progress, selection),
                        format_report, args.json, BaselineFiles.from_args(args))
