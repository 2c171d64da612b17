"""`python -m harness`: the `harness` command, for an environment whose scripts are not on PATH (or a checkout run
in place, without the install)."""
import sys

from harness.cli import main

if __name__ == "__main__":
    sys.exit(main())
