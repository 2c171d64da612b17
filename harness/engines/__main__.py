"""`python -m harness.engines ARGS` is `harness engine-check ARGS` (harness/engines/command.py) without the rest of the
CLI: what `--releases` and the pytest plugin run, one process per check."""
from __future__ import annotations

import argparse
import sys

from harness.engines.command import add_arguments, main

parser = argparse.ArgumentParser(prog="python -m harness.engines", description="harness engine-check")
add_arguments(parser)
sys.exit(main(parser.parse_args()))
