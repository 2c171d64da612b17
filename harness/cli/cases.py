"""The case-file commands (`harness list`, `new-case`, `case-schema`) and the cases a command runs: named ones, or
every case in --cases-dir (default: the shipped ones)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from harness.case import CASES_DIR, CaseError, default_cases, load_case
from harness.errors import UsageError
from harness.golden.base import GOLDEN_DIR


def cases_dir(args) -> Path:
    return Path(getattr(args, "cases_dir", None) or CASES_DIR)


def golden_dir(args) -> Path:
    return Path(getattr(args, "golden_dir", None) or GOLDEN_DIR)


def named_cases(names: Sequence[str], args=None):
    """The named cases, else every case in --cases-dir (default: the shipped ones); none at all is an error."""
    d = cases_dir(args)
    if names:
        return [load_case(n, d) for n in names]
    cases = default_cases(d)
    if not cases:
        where = f"{d} (no such directory)" if not d.is_dir() else f"{d} (no *.toml in it)"
        raise UsageError(f"no cases: looked in {where}; name case files, or pass --cases-dir DIR")
    return cases


def add_cases_dir(s: argparse.ArgumentParser) -> None:
    s.add_argument("--cases-dir", metavar="DIR", help=f"where case names are looked up and what runs by default (default: {CASES_DIR})")


def cmd_list(args) -> int:
    cases = named_cases(args.cases, args)
    if args.json:
        print(json.dumps([{"case": c.name, "layout": c.layout.describe(), "branch": c.layout.branch.value, "world_size": c.layout.world_size,
                           "description": c.description, "path": c.path} for c in cases], indent=2))
        return 0
    width = max(len(c.name) for c in cases)
    for c in cases:
        print(f"{c.name:<{width}}  {c.layout.describe():<48} world={c.layout.world_size}  {c.description}")
    return 0


def cmd_new_case(args) -> int:
    from harness.case_template import case_file_path, coverage, new_case, parse_batches
    from runners.config import SpecConfig
    from runners.parallel.layout import LayoutError, ParallelLayout

    target = case_file_path(args.name, args.dir)
    try:
        layout = ParallelLayout(args.tp, args.dp, args.dp > 1, args.dense_tp, args.dp_lm_head, args.a2a)
    except LayoutError as e:
        field, _, rule = str(e).partition(": ")
        raise CaseError(target, field, rule) from None
    try:
        capture_bs = tuple(int(x) for x in args.capture_bs.split(","))
    except ValueError:
        raise CaseError(target, "spec.capture_bs", "comma-separated integers (--capture-bs 1,2,4,8)", args.capture_bs) from None
    spec = SpecConfig(num_steps=args.steps, topk=args.topk, num_draft_tokens=args.tokens_per_bs,
                      capture_bs=capture_bs, max_running_requests=args.max_running_requests)
    batches = parse_batches(args.batches) if args.batches else None
    others = coverage(layout, default_cases())
    path, case = new_case(args.name, layout, spec, batches, args.description, args.seed, args.dir, args.force)
    from harness.golden import show

    print(f"wrote {show(path)}")
    print(f"  layout   {case.layout.describe()}  (world {case.layout.world_size}, attn_tp {case.layout.attn_tp_size}, capture_bs base {case.layout.capture_bs_base})")
    print(f"  schedule {[list(b) for b in case.schedule]}  (per iteration, each DP group's raw bs; 0 = idle)")
    print(f"  same branch and tp/dp already in: {', '.join(others) if others else 'none: this is new coverage'}")
    if args.record:
        from harness.golden.lifecycle import record_golden

        print(record_golden(case, golden_dir(args)).format())
        print(f"next: harness check {args.name}, then commit {show(path)} with golden/{args.name}.npz and golden/{args.name}.json")
    else:
        print(f"next: harness check {args.name}  then  harness golden record {args.name}")
    return 0


def cmd_case_schema(args) -> int:
    from harness.case_schema import case_json_schema

    print(json.dumps(case_json_schema(), indent=2))
    return 0


def add_parsers(subparsers) -> None:
    s = subparsers.add_parser("list", help="list cases with layout and branch")
    s.add_argument("cases", nargs="*", help="case names or paths (default: every case in cases/)")
    s.add_argument("--json", action="store_true")
    add_cases_dir(s)
    s.set_defaults(func=cmd_list)

    s = subparsers.add_parser("new-case", help="write cases/<name>.toml for a parallel config (then: harness golden record <name>)")
    s.add_argument("name", help="case name: the file is cases/<name>.toml, its golden golden/<name>.npz")
    s.add_argument("--tp", type=int, required=True, help="tp_size (ranks in all)")
    s.add_argument("--dp", type=int, default=1, help="dp_size; > 1 turns on DP attention")
    s.add_argument("--dense-tp", type=int, choices=(1,), help="moe_dense_tp_size 1 (replicated dense MLP); unset: TP over all ranks")
    s.add_argument("--dp-lm-head", action="store_true", help="enable_dp_lm_head")
    s.add_argument("--a2a", default="none", help="moe_a2a_backend (none, deepep, mooncake, flashinfer)")
    s.add_argument("--steps", type=int, default=3, help="spec num_steps (default 3)")
    s.add_argument("--topk", type=int, default=1)
    s.add_argument("--tokens-per-bs", type=int, help="num_tokens_per_bs (default num_steps + 1)")
    s.add_argument("--capture-bs", default="1,2,4,8", help="comma-separated capture buckets (default 1,2,4,8)")
    s.add_argument("--max-running-requests", type=int, default=8)
    s.add_argument("--batches", help="schedule, e.g. '6,5 3,1 1,0': iterations by spaces, DP groups by commas (default: shrink + idle group)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--description")
    s.add_argument("--dir", help="where to write (default: cases/)")
    s.add_argument("--golden-dir", help="where --record writes (default: golden/)")
    s.add_argument("--force", action="store_true", help="overwrite an existing case file")
    s.add_argument("--record", action="store_true", help="record its golden right away")
    s.set_defaults(func=cmd_new_case)

    s = subparsers.add_parser("case-schema", help="print the JSON Schema of case files (for editors; the loader checks the rest)")
    s.set_defaults(func=cmd_case_schema)
