"""`python -m harness.bench ARGS`: `harness bench ARGS` without the rest of the CLI (benchmarks/gpu_run.sh)."""
from __future__ import annotations

import sys

from harness.bench.command import standalone

sys.exit(standalone())
