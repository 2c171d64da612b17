"""`python -m harness.cli`: the `harness` command (as `python -m harness`)."""
import sys

from harness.cli import main

sys.exit(main())
