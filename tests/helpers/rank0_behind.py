"""`python -m tests.helpers.rank0_behind ARGS`: `harness ARGS`, with rank 0 of a launch starting a second behind the others.

Under torchrun, a launch whose ranks all refuse must still say why: torchrun stops the remaining processes once one exits
with an error, so rank 0 (the one that reports) must not be stopped by the others leaving first. Starting it late makes
that order certain instead of a matter of load.
"""
from __future__ import annotations

import os
import runpy
import sys
import time

if __name__ == "__main__":
    if os.environ.get("RANK") == "0":
        time.sleep(1.0)
    sys.argv = ["harness", *sys.argv[1:]]
    runpy.run_module("harness.cli", run_name="__main__")
