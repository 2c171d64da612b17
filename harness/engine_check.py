"""`python -m harness.engine_check` (= `harness engine-check`): the command lives in harness/engines/command.py."""
from __future__ import annotations

import argparse
import sys

from harness.engines.command import add_arguments, add_parser, main

__all__ = ["add_parser", "main"]

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m harness.engine_check", description="harness engine-check")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
