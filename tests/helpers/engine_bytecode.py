"""Load each engine release the suite checks once, as a check loads it, so its bytecode is written before pytest starts:
`python -m tests.helpers.engine_bytecode`.

.ci/run starts this in the background once the project is installed (it needs torch; the installs it waits for need
only the standard library and start earlier, in tests/helpers/prefetch_engines.py). Each release is installed here
when the prefetch has not done so yet: both take the same file lock per release, so a release is installed once and
loaded once it is complete. Loading writes the release's bytecode and, the first time, that of the torch modules the
suite's engine checks preload (tests/helpers/engine_releases.py, write_bytecode). Each line says how long a release's
load took; the exit status is the number of releases that failed to install or load (their tests then try again).
"""
from __future__ import annotations

import sys
import time

from harness.engines.install import InstallError
from tests.helpers.engine_releases import BytecodeError, write_bytecode
from tests.helpers.prefetch_engines import RELEASES


def main() -> int:
    failed = 0
    for engine, version, install in RELEASES:
        start = time.monotonic()
        try:
            write_bytecode(f"{engine}=={version}", install(version, log=lambda msg: None))
        except (InstallError, BytecodeError) as e:
            failed += 1
            print(f"{engine}=={version}: not loaded: {e}", flush=True)
            continue
        print(f"{engine}=={version}: loaded, its bytecode written ({time.monotonic() - start:.1f} s)", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
