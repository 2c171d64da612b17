"""`harness engine-check --engine sglang|vllm[==VERSION] [--json]`: our invariants on the engine's own runners.

One line per (runner, layout/branch, bucket), then a verdict. Exit 0: every check held;
1: a check failed; 2: the engine could not be checked (not installed, or the adapter cannot
drive this release: the message says what moved); 3: the release is outside what the
adapter claims (n/a, with the reason). `--releases` checks many releases of either engine
into one table. See docs/engine-check.md.

Every SGLang-specific stub and shim lives in harness/engines/sglang/; installs come from
harness/engines/install.py (`python -m harness.engine_install sglang==X`, or --install here).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Optional

from harness.engines.check import REPRESENTATIVE_LAYOUTS, check_engine
from harness.engines.drive import cannot_check, drive_engine
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
from harness.engines.releases import PRODUCTS, run_releases
from harness.engines.report import format_report
from harness.engines.sglang.config import EngineConfig
from harness.engines.sglang.loader import load
from harness.engines.vllm.command import main as vllm_main
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
    p.add_argument("--engine", required=True, help="sglang[==VERSION] or vllm[==VERSION] (vLLM's EAGLE proposer: docs/engine-check.md)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.add_argument("--target", metavar="DIR", help="the sglang install to check (a pip --target dir); default .engines/sglang-VERSION")
    p.add_argument("--deps", metavar="DIR", help="where msgspec/dill/regex/packaging live (default .engines/deps)")
    p.add_argument("--install", action="store_true", help="install sglang==VERSION into the default place first if it is missing")
    p.add_argument("--all-layouts", action="store_true", help="every valid layout up to tp8, not one or two per branch")
    p.add_argument("--eager", action="store_true",
                   help="sglang: also check I7 on the engine's eager draft-extend path (the scheduler's MLP sync and the worker's "
                        "eager batch; docs/engine-check.md, I7: it fails every release checked so far)")
    p.add_argument("--releases", metavar="SPEC",
                   help="install and check each release ('all' from the oldest carrying the checked path: sglang's multi-layer "
                        "draft-extend runner, vllm's model-runner-v2 EAGLE speculator; 'A,B,C', or 'A..B'); one table (or --json)")


def _resolve(args) -> tuple[Optional[Path], Optional[Path]]:
    spec = EngineSpec.parse(args.engine)
    deps = Path(args.deps) if args.deps else deps_dir()
    if args.target:
        return Path(args.target), deps
    if spec.version is not None:
        how = f"run `python -m harness.engine_install {spec}` or pass --install"
        return release_dir(spec, engine_dir(spec.version), args.install, ensure_installed, how), deps
    if importlib.util.find_spec("sglang") is not None:
        return None, deps  # the environment's own sglang
    versions = installed_versions()
    if not versions:
        raise FileNotFoundError(f"no sglang in this environment and none under {engines_root()}: give --engine sglang==VERSION --install")
    return engine_dir(versions[-1]), deps


def main(args) -> int:
    if args.releases:
        try:
            spec = EngineSpec.parse(args.engine)
        except ValueError as e:
            return cannot_check(str(e), args.json)
        if spec.version is not None or args.target:
            return cannot_check(f"--releases picks the versions: give --engine {spec.name}, without ==VERSION or --target", args.json)
        extra = [flag for flag, on in (("--all-layouts", args.all_layouts), ("--eager", args.eager)) if on and spec.name == "sglang"]
        return run_releases(args.releases, args.json, extra, lambda m: print(m, file=sys.stderr, flush=True), PRODUCTS[spec.name])
    if args.engine.strip().lower().startswith("vllm"):
        if args.eager:
            return cannot_check("--eager checks SGLang's eager draft-extend path; vLLM's adapter has no eager check", args.json)
        return vllm_main(args)
    try:
        spec = EngineSpec.parse(args.engine)
        target, deps = _resolve(args)
    except (FileNotFoundError, ValueError, InstallError) as e:
        return cannot_check(str(e), args.json)
    layouts = tuple(all_layouts(8) if args.all_layouts else REPRESENTATIVE_LAYOUTS)
    cfg = EngineConfig()
    return drive_engine(spec, lambda: load(target, deps), lambda engine, progress: check_engine(engine, layouts, cfg, progress, eager=args.eager),
                        lambda rep: format_report(rep, cfg), args.json)

