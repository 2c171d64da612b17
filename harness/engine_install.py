"""`python -m harness.engine_install sglang==X ...`: installs live in harness/engines/install.py."""
from __future__ import annotations

import sys

from harness.engines.install import main

if __name__ == "__main__":
    sys.exit(main())
