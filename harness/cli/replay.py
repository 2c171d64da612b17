"""`harness replay CASE`: rerun one case step by step and show the first divergence."""
from __future__ import annotations

import json
import sys

from harness.cases.case import load_case
from harness.cli.cases import add_cases_dir, cases_dir
from harness.cli.options import RUNNER_OPTION, add_ranks
from harness.cli.ranks import mutant_ctx
from harness.errors import UsageError


def cmd_replay(args) -> int:
    from harness.pipeline.dump import dump_case, target_of  # torch: only when a replay runs
    from harness.pipeline.replay import check_filters, format_table, replay_case

    case = load_case(args.case, cases_dir(args))
    try:
        check_filters(case, args.step, args.rank)
    except ValueError as e:
        raise UsageError(f"harness replay: {e}") from None
    with mutant_ctx(args.mutant):
        progress = None if args.json else (lambda msg: print(f"... {msg}", file=sys.stderr, flush=True))
        rep = replay_case(case, step=args.step, rank=args.rank, progress=progress, ranks=args.ranks, runner=args.runner)
        if args.dump:
            div = rep.first_divergence()
            it, step, why = target_of(div, args.step)
            if progress:
                progress(f"dumping every rank at iteration {it}, step {step} ({why}) to {args.dump}")
            rep.dump = str(dump_case(case, args.dump, it, step, runner=args.runner, why=why, divergence=div))
    if args.json:
        print(json.dumps(rep.to_json(), indent=2, default=str))
    else:
        print(format_table(rep))
    return 0 if rep.ok else 1


def add_parser(subparsers) -> None:
    s = subparsers.add_parser("replay", help="rerun one case step by step and show the first divergence")
    s.add_argument("case", help="case name (in cases/) or path to a .toml")
    s.add_argument("--step", type=int, help="only this draft step")
    s.add_argument("--rank", type=int, help="only this rank")
    s.add_argument("--mutant", help="plant a mutant first, e.g. sglang-26416")
    add_ranks(s)
    s.add_argument("--runner", type=RUNNER_OPTION, metavar=RUNNER_OPTION.choices_text, default="both",
                   help="both: eager vs graph (P3) and each vs TP1 (P4); eager or graph: that runner alone vs the TP1 oracle")
    s.add_argument("--dump", metavar="DIR", help="write every rank's buffers and metadata at the first divergence to DIR (np.load-able .npz)")
    s.add_argument("--json", action="store_true")
    add_cases_dir(s)
    s.set_defaults(func=cmd_replay)
