"""`harness engine-check --engine sglang|vllm[==VERSION] [--json]`: our invariants on the engine's own runners.

One line per (runner, layout/branch, bucket, device path), then a verdict. Exit 0: every check
held (with --baseline: every finding is a known one); 1: a check failed (a new finding); 2: the
engine could not be checked (not installed, the adapter cannot drive this release -- the
message says what moved --, or a bad baseline file), decided before any check runs; 3: the
release is outside what the adapter claims (n/a, with the reason). `--path` and `--runner`
select what runs; `--releases` checks many releases of either engine into one table. See
docs/engine-check.md.

Every SGLang-specific stub and shim lives in harness/engines/sglang/; installs come from
harness/engines/install.py (`python -m harness.engines.install sglang==X`, or --install here).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Optional

from harness.engines.check import REPRESENTATIVE_LAYOUTS, check_engine
from harness.engines.check import RUNNERS as SGLANG_RUNNERS
from harness.engines.drive import BaselineFiles, cannot_check, drive_engine
from harness.engines.install import (
    EngineSpec,
    InstallError,
    deps_dir,
    engine_dir,
    engines_root,
    ensure_installed,
    installed_versions,
    release_dir,
)
from harness.engines.options import PATH_CHOICES, FillPath, Selection
from harness.engines.releases import PRODUCTS, run_releases
from harness.engines.report import format_report
from harness.engines.sglang.config import EngineConfig
from harness.engines.sglang.loader import load
from harness.engines.vllm.command import main as vllm_main
from harness.engines.vllm.drive import RUNNERS as VLLM_RUNNERS
from harness.engines.vllm_ascend.command import main as vllm_ascend_main
from harness.run.layouts import all_layouts


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "engine-check",
        help="our invariants on an installed SGLang's or vLLM's own graph runners (CPU, no model, no GPU)",
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=main)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", required=True, help="sglang[==VERSION], vllm[==VERSION] (vLLM's EAGLE proposer: docs/engine-check.md) or "
                   "vllm-ascend[==VERSION] (its merged draft ACL graph: docs/engine-check-vllm-ascend.md)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.add_argument("--target", metavar="DIR", help="the sglang install to check (a pip --target dir); default .engines/sglang-VERSION")
    p.add_argument("--deps", metavar="DIR", help="where msgspec/dill/regex/packaging live (default .engines/deps)")
    p.add_argument("--install", action="store_true", help="install sglang==VERSION into the default place first if it is missing")
    p.add_argument("--all-layouts", action="store_true", help="every valid layout up to tp8, not one or two per branch")
    p.add_argument("--eager", action="store_true",
                   help="sglang: also check I7 on the engine's eager draft-extend path (the scheduler's MLP sync and the worker's "
                        "eager batch; docs/engine-check.md, I7: it fails every release checked so far)")
    p.add_argument("--path", choices=PATH_CHOICES, default="all",
                   help="the device path to check where the engine has device-specific code (SGLang from 0.5.17: gpu = prepare()'s "
                        "Triton fill kernel on every replay, npu = its native twin); code both devices run is checked either way; "
                        "the report says what was left out (default: all)")
    p.add_argument("--runner", action="append", choices=sorted(set(SGLANG_RUNNERS) | set(VLLM_RUNNERS)), metavar="RUNNER",
                   help=f"check this runner only (repeat for more); sglang: {', '.join(SGLANG_RUNNERS)}; vllm: {', '.join(VLLM_RUNNERS)}")
    known = p.add_mutually_exclusive_group()
    known.add_argument("--baseline", metavar="FILE",
                       help="known findings (written by --write-baseline): exit 0 when every finding is in FILE, 1 on any new one; "
                            "--json marks each failure new or known, and entries no longer found are reported as stale")
    known.add_argument("--write-baseline", metavar="FILE", help="write this run's findings to FILE as the known ones (then exit 0)")
    p.add_argument("--releases", metavar="SPEC",
                   help="install and check each release ('all' from the oldest carrying the checked path: sglang's multi-layer "
                        "draft-extend runner, vllm's model-runner-v2 EAGLE speculator; 'A,B,C', or 'A..B'); one table (or --json)")


def _resolve(args) -> tuple[Optional[Path], Optional[Path]]:
    spec = EngineSpec.parse(args.engine)
    deps = Path(args.deps) if args.deps else deps_dir()
    if args.target:
        return Path(args.target), deps
    if spec.version is not None:
        how = f"run `python -m harness.engines.install {spec}` or pass --install"
        return release_dir(spec, engine_dir(spec.version), args.install, ensure_installed, how), deps
    if importlib.util.find_spec("sglang") is not None:
        return None, deps  # the environment's own sglang
    versions = installed_versions()
    if not versions:
        raise FileNotFoundError(f"no sglang in this environment and none under {engines_root()}: give --engine sglang==VERSION --install")
    return engine_dir(versions[-1]), deps


def main(args) -> int:
    if args.engine.strip().lower().startswith("vllm-ascend"):  # an adapter of its own: vLLM's EAGLE proposer on the NPU path
        return vllm_ascend_main(args)
    try:
        name = EngineSpec.parse(args.engine).name
    except ValueError as e:
        return cannot_check(str(e), args.json)
    runners = SGLANG_RUNNERS if name == "sglang" else VLLM_RUNNERS
    foreign = sorted(set(args.runner or ()) - set(runners))
    if foreign:
        return cannot_check(f"--runner {foreign[0]}: not a runner of the {name} adapter (one of {', '.join(runners)})", args.json)
    selection = Selection.from_args(args.path, args.runner)
    if args.releases:
        spec = EngineSpec.parse(args.engine)
        if spec.version is not None or args.target:
            return cannot_check(f"--releases picks the versions: give --engine {spec.name}, without ==VERSION or --target", args.json)
        if args.write_baseline:
            return cannot_check("--write-baseline writes one run's findings; with --releases give --baseline (each release against it)",
                                args.json)
        extra = [flag for flag, on in (("--all-layouts", args.all_layouts), ("--eager", args.eager)) if on and spec.name == "sglang"]
        extra += ["--path", args.path] + [a for r in args.runner or () for a in ("--runner", r)]
        extra += ["--baseline", str(Path(args.baseline).resolve())] if args.baseline else []
        return run_releases(args.releases, args.json, extra, lambda m: print(m, file=sys.stderr, flush=True), PRODUCTS[spec.name])
    if name == "vllm":
        if args.eager:
            return cannot_check("--eager checks SGLang's eager draft-extend path; vLLM's adapter has no eager check", args.json)
        if FillPath.NPU in selection.paths and args.path != "all":
            return cannot_check("--path npu: vLLM's adapter drives model runner v2's CUDA-graph path only (no NPU path)", args.json)
        return vllm_main(args, selection)
    try:
        spec = EngineSpec.parse(args.engine)
        target, deps = _resolve(args)
    except (FileNotFoundError, ValueError, InstallError) as e:
        return cannot_check(str(e), args.json)
    layouts = tuple(all_layouts(8) if args.all_layouts else REPRESENTATIVE_LAYOUTS)
    cfg = EngineConfig()
    return drive_engine(spec, lambda: load(target, deps),
                        lambda engine, progress: check_engine(engine, layouts, cfg, progress, eager=args.eager, selection=selection),
                        lambda rep: format_report(rep, cfg), args.json, BaselineFiles.from_args(args))
