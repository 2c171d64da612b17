"""`harness engine-check --engine vllm-ascend==VERSION [--install] [--json] [--target DIR]`: our invariants on
vllm-ascend's merged EAGLE draft ACL graph.

One line per (world, bucket), the invariants that do not apply with their reason, then a
verdict. Exit 0: every check held; 1: a check failed; 2: the release could not be checked (not
installed, or the adapter cannot drive it: the message says what moved); 3: the release does
not carry the merged draft graph (n/a, with the reason).
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

from harness.engines.drive import BaselineFiles, cannot_check, drive_engine
from harness.engines.install import EngineSpec, InstallError, deps_dir, is_installed
from harness.engines.vllm.install import vllm_deps_dir
from harness.engines.vllm_ascend.checks import NOT_APPLICABLE, check_capture, check_step, line_for
from harness.engines.vllm_ascend.config import AscendCheckConfig
from harness.engines.vllm_ascend.drive import drive_world
from harness.engines.vllm_ascend.install import (
    PACKAGE,
    ascend_dir,
    ensure_ascend_installed,
    installed_ascend_versions,
    paired_vllm_dir,
)
from harness.engines.vllm_ascend.loader import AscendEngine, load
from harness.engines.vllm_ascend.report import AscendReport, format_report
from harness.ranks.simulated import one_torch_thread


@one_torch_thread()  # tiny tensors: torch's intra-op pool only spins (harness/ranks/simulated.py)
def check_ascend(engine: AscendEngine, cfg: Optional[AscendCheckConfig] = None,
                 progress: Optional[Callable[[str], None]] = None) -> AscendReport:
    cfg = cfg or AscendCheckConfig()
    t0 = time.perf_counter()
    lines: dict = {}
    for world in cfg.worlds():
        if progress:
            progress(world.label)
        ranks, replays = drive_world(engine, cfg, world)
        for d in ranks:
            check_capture(line_for(lines, world, "capture"), world, d.rank, d.captures, cfg)
        by_iter: dict[int, list] = {}
        for r in replays:
            by_iter.setdefault(r.iteration, []).append(r)
        for _, reps in sorted(by_iter.items()):
            check_step(lines, world, reps, cfg)
    order = [w.label for w in cfg.worlds()]
    ordered = sorted(lines.values(), key=lambda ln: (order.index(ln.world), ln.bucket != "capture", _tokens(ln.bucket)))
    return AscendReport(engine.version, engine.vllm_version, engine.location, asdict(cfg), ordered, [*NOT_APPLICABLE, engine.v2_note],
                        engine.stubbed, dict(engine.runner_where), time.perf_counter() - t0)


def _tokens(bucket: str) -> int:
    return int(bucket.split("=")[1]) if bucket.startswith("tokens=") else 10**9


def parse_spec(text: str) -> EngineSpec:
    name, sep, version = text.strip().partition("==")
    if name.strip().lower() != PACKAGE:
        raise ValueError(f"--engine: '{PACKAGE}[==VERSION]' (got {text!r})")
    version = version.strip() or None
    if sep and not version:
        raise ValueError(f"--engine: empty version in {text!r}")
    return EngineSpec(PACKAGE, version)


def _resolve(spec: EngineSpec, args) -> Path:
    if args.target:
        return Path(args.target)
    if spec.version is None:
        versions = installed_ascend_versions()
        if not versions:
            raise FileNotFoundError(f"no {PACKAGE} installed: give --engine {PACKAGE}==VERSION --install")
        return ascend_dir(versions[-1])
    target = ascend_dir(spec.version)
    if not is_installed(target):
        if not args.install:
            raise FileNotFoundError(f"{spec} is not installed at {target}: pass --install")
        ensure_ascend_installed(spec.version, log=lambda m: print(m, flush=True, file=sys.stderr))
    return target


def main(args) -> int:
    if getattr(args, "eager", False):
        return cannot_check("--eager checks SGLang's eager draft-extend path; the vllm-ascend adapter has no eager check", args.json)
    if args.path == "gpu":
        return cannot_check("--path gpu: the vllm-ascend adapter drives the NPU path only (--path npu or all)", args.json)
    if args.runner:
        return cannot_check(f"--runner {args.runner[0]}: the vllm-ascend adapter drives one runner, the merged draft graph "
                            "(leave --runner out)", args.json)
    try:
        spec = parse_spec(args.engine)
        tree = _resolve(spec, args)
        vllm_target = paired_vllm_dir(tree)
    except (FileNotFoundError, ValueError, InstallError) as e:
        return cannot_check(str(e), args.json)
    deps = [Path(args.deps)] if args.deps else [deps_dir(), vllm_deps_dir()]
    return drive_engine(spec, lambda: load(tree, vllm_target, deps),
                        lambda engine, progress: check_ascend(engine, AscendCheckConfig(), progress), format_report, args.json,
                        BaselineFiles.from_args(args))
