"""`harness new-case NAME --tp N ...`: write a case file for a parallel config, and with --record every golden its
checks read. A flag the case can't hold is reported against the flag (nothing is written); the branch the flags give
is printed, and --branch requires one."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional

from harness.cases.case import CASES_DIR, CaseError, default_cases, parse_layout
from harness.cli.cases import add_golden_dir
from harness.errors import UsageError
from harness.golden.place import USER_GOLDEN_SUBDIR, check_writable, golden_dir_for
from runners.parallel.layout import Branch, LayoutError, ParallelLayout

# a case file's field -> the new-case flag that sets it
FLAGS = {"layout.tp_size": "--tp", "layout.dp_size": "--dp", "layout.enable_dp_attention": "--dp", "layout.moe_dense_tp_size": "--dense-tp",
         "layout.enable_dp_lm_head": "--dp-lm-head", "layout.moe_a2a_backend": "--a2a", "spec.num_steps": "--steps", "spec.topk": "--topk",
         "spec.num_tokens_per_bs": "--tokens-per-bs", "spec.capture_bs": "--capture-bs", "spec.max_running_requests": "--max-running-requests",
         "schedule.batches": "--batches", "seed": "--seed", "description": "--description", "name": "NAME"}
_DEST = {"--tp": "tp", "--dp": "dp", "--dense-tp": "dense_tp", "--dp-lm-head": "dp_lm_head", "--a2a": "a2a", "--steps": "steps", "--topk": "topk",
         "--tokens-per-bs": "tokens_per_bs", "--capture-bs": "capture_bs", "--max-running-requests": "max_running_requests",
         "--batches": "batches", "--seed": "seed", "--description": "description", "NAME": "name"}
# flag sets tried, in order, to show a command that reaches a branch the flags missed
_BRANCH_RECIPES = ({}, {"moe_dense_tp_size": 1}, {"moe_a2a_backend": "deepep"}, {"dp": True},
                   {"dp": True, "moe_dense_tp_size": 1, "enable_dp_lm_head": True, "moe_a2a_backend": "deepep"},
                   {"dp": "all", "moe_dense_tp_size": 1, "enable_dp_lm_head": True, "moe_a2a_backend": "deepep"})


def flag_error(e: CaseError, args) -> UsageError:
    """A case-file error from what the flags built, said against the flag (no file was written)."""
    flag = FLAGS.get(e.field.split("[")[0])
    if flag is None:  # a field no flag sets (model, tolerances): name the field
        return UsageError(f"harness new-case: {e.field}: expected {e.expected} (nothing was written)")
    value = getattr(args, _DEST[flag], None)
    shown = flag if isinstance(value, bool) or value is None else f"{flag} {value}"
    rule = e.expected.replace("enable_dp_attention", "enable_dp_attention (--dp > 1)")
    # a layout rule reads as a sentence ("tp_size (3) must be divisible by dp_size (2)"); the loader's checks as what was expected
    sentence = e.field.startswith("layout.") and not rule.startswith(("a ", "an "))
    return UsageError(f"harness new-case: {shown}: {'' if sentence else 'expected '}{rule} (case field {e.field}; nothing was written)")


def _recipe_layout(tp: int, recipe: dict) -> Optional[ParallelLayout]:
    kw = dict(recipe)
    dp = kw.pop("dp", None)
    if dp is not None:
        dp = tp if dp == "all" else next((d for d in range(2, tp + 1) if tp % d == 0), None)
        if dp is None:
            return None
        kw.update(dp_size=dp, enable_dp_attention=True)
    try:
        return ParallelLayout(tp, **kw)
    except LayoutError:
        return None


def _flags_of(layout: ParallelLayout) -> str:
    parts = [f"--tp {layout.tp_size}"]
    if layout.enable_dp_attention:
        parts.append(f"--dp {layout.dp_size}")
    if layout.moe_dense_tp_size is not None:
        parts.append(f"--dense-tp {layout.moe_dense_tp_size}")
    if layout.enable_dp_lm_head:
        parts.append("--dp-lm-head")
    if layout.moe_a2a_backend != "none":
        parts.append(f"--a2a {layout.moe_a2a_backend}")
    return " ".join(parts)


def require_branch(layout: ParallelLayout, want: Optional[Branch], name: str) -> None:
    """--branch: the flags must give it; the error shows flags (at this --tp) that do."""
    if want is None or layout.branch is want:
        return
    reach = next((lay for r in _BRANCH_RECIPES if (lay := _recipe_layout(layout.tp_size, r)) is not None and lay.branch is want), None)
    how = (f"e.g. harness new-case {name} {_flags_of(reach)}" if reach is not None
           else f"no layout at --tp {layout.tp_size} does (mlp_tp_gather and attn_tp_gather with DP attention need --tp >= 2)")
    raise UsageError(f"harness new-case: --branch {want.value}: the flags ({_flags_of(layout)}) give {layout.branch.value}; {how}")


def cmd_new_case(args) -> int:
    from harness.cases.template import case_file_path, coverage, new_case, parse_batches
    from harness.golden import show
    from runners.config import SpecConfig

    directory = Path(args.dir) if args.dir else CASES_DIR
    target = case_file_path(args.name, directory)
    try:
        layout = parse_layout(target, {"tp_size": args.tp, "dp_size": args.dp, "enable_dp_attention": args.dp > 1,
                                       **({"moe_dense_tp_size": args.dense_tp} if args.dense_tp is not None else {}),
                                       "enable_dp_lm_head": args.dp_lm_head, "moe_a2a_backend": args.a2a})
        require_branch(layout, args.branch, args.name)
        try:
            capture_bs = tuple(int(x) for x in args.capture_bs.split(","))
        except ValueError:
            raise CaseError(target, "spec.capture_bs", "comma-separated integers (--capture-bs 1,2,4,8)", args.capture_bs) from None
        spec = SpecConfig(num_steps=args.steps, topk=args.topk, num_draft_tokens=args.tokens_per_bs,
                          capture_bs=capture_bs, max_running_requests=args.max_running_requests)
        batches = parse_batches(args.batches) if args.batches else None
        check_writable(directory, flags="--dir DIR (its goldens go to DIR/golden/)")
        if args.record:  # refused before the case file is written, not after
            check_writable(Path(args.golden_dir) if args.golden_dir else golden_dir_for(directory), flags="--dir DIR or --golden-dir DIR")
        path, case = new_case(args.name, layout, spec, batches, args.description, args.seed, directory, args.force)
    except CaseError as e:
        if e.field.startswith("<"):  # about the file itself (it exists): that file is real
            raise
        raise flag_error(e, args) from None
    others = [n for n in coverage(layout, default_cases()) if n != args.name]
    print(f"wrote {show(path)}")
    lay = case.layout
    print(f"  layout   {lay.describe()}  (world {lay.world_size}, attn_tp {lay.attn_tp_size}, capture_bs base {lay.capture_bs_base})")
    given = "as --branch asked" if args.branch else "from the flags; --branch BRANCH requires one"
    print(f"  branch   {case.layout.branch.value}  ({given})")
    print(f"  schedule {[list(b) for b in case.schedule]}  (per iteration, each DP group's raw bs; 0 = idle)")
    print(f"  same branch and tp/dp already in: {', '.join(others) if others else 'none: this is new coverage'}")
    dir_flag = "" if directory.resolve() == CASES_DIR.resolve() else f" --cases-dir {shlex.quote(show(directory))}"
    gdir_flag = f" --golden-dir {shlex.quote(args.golden_dir)}" if args.golden_dir else ""
    if not args.record:
        print(f"next: harness check {args.name}{dir_flag}, then harness golden record {args.name}{dir_flag}{gdir_flag} (every golden its "
              f"checks read; or new-case --record), then harness check {args.name}{dir_flag} --props all")
        return 0
    from harness.golden.case_goldens import kind_paths, record_case_goldens

    outcomes = record_case_goldens(case, Path(args.golden_dir) if args.golden_dir else None)
    missing = [o for o in outcomes if not o.recorded]
    files = [show(p) for o in outcomes if o.recorded for p in kind_paths(case, o.kind, Path(args.golden_dir) if args.golden_dir else None)]
    print(f"next: harness check {args.name}{dir_flag} --props all; keep {show(path)} with {', '.join(files)}")
    if missing:
        print(f"still missing: {', '.join(str(o.kind) for o in missing)} (see above)")
        return 1
    return 0


def add_parser(subparsers) -> None:
    s = subparsers.add_parser("new-case", help="write <dir>/<name>.toml for a parallel config (--record: and every golden its checks read)")
    s.add_argument("name", help="case name: the file is <dir>/<name>.toml")
    s.add_argument("--tp", type=int, required=True, help="tp_size (ranks in all)")
    s.add_argument("--dp", type=int, default=1, help="dp_size; > 1 turns on DP attention")
    s.add_argument("--dense-tp", type=int, choices=(1,), help="moe_dense_tp_size 1 (replicated dense MLP); unset: TP over all ranks")
    s.add_argument("--dp-lm-head", action="store_true", help="enable_dp_lm_head")
    s.add_argument("--a2a", default="none", help="moe_a2a_backend (none, deepep, mooncake, flashinfer)")
    s.add_argument("--branch", type=Branch, choices=list(Branch), metavar="{" + ",".join(b.value for b in Branch) + "}",
                   help="the get_forward_batch branch the case must take: refused unless the flags give it (omitted: printed)")
    s.add_argument("--steps", type=int, default=3, help="spec num_steps (default 3)")
    s.add_argument("--topk", type=int, default=1)
    s.add_argument("--tokens-per-bs", type=int, help="num_tokens_per_bs (default num_steps + 1; with --topk 1 it must be that)")
    s.add_argument("--capture-bs", default="1,2,4,8", help="comma-separated capture buckets (default 1,2,4,8)")
    s.add_argument("--max-running-requests", type=int, default=8)
    s.add_argument("--batches", help="schedule, e.g. '6,5 3,1 1,0': iterations by spaces, DP groups by commas (default: shrink + idle group)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--description")
    s.add_argument("--dir", help=f"where to write (default: the shipped cases, {CASES_DIR}, writable in a checkout only); "
                                 f"its goldens go to DIR/{USER_GOLDEN_SUBDIR}/")
    add_golden_dir(s, "--record writes")
    s.add_argument("--force", action="store_true", help="overwrite an existing case file")
    s.add_argument("--record", action="store_true", help="record every golden its checks read right away (arrays, acceptance, draft trees)")
    s.set_defaults(func=cmd_new_case)
