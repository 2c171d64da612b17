"""Install the engine releases the engine tests check before they start: `python -m tests.helpers.prefetch_engines`.

.ci/run starts this in the background while `harness check` and the offline suite run, so the downloads (about 2 GB,
a minute of network) overlap those steps instead of holding an xdist worker in the engine step. It installs where the
tests look ($SPECHARNESS_ENGINES, else .engines/). The list is a shortcut, not a contract: a test
whose release is missing here still installs it on first use (tests/helpers/engine_releases.py, under the same file
lock), only later. Each line says which release it installs and how long it took; the exit status is the number of
releases that failed to install (their tests then try again and skip naming the error).
"""
from __future__ import annotations

import sys
import time
from typing import Callable

from harness.engines.install import InstallError, ensure_installed
from harness.engines.vllm.install import ensure_vllm_installed
from harness.engines.vllm_ascend.install import ensure_ascend_installed

# (engine, version, installer): the releases tests/test_engine_*.py and tests/test_plugin_engine.py read
RELEASES: tuple[tuple[str, str, Callable[..., object]], ...] = (
    ("sglang", "0.5.23", ensure_installed),  # the newest checked release (NEWEST)
    ("sglang", "0.5.14", ensure_installed),  # the first release without the seed bug (FIXED)
    ("sglang", "0.5.13.post1", ensure_installed),  # the seed bug's last release
    ("sglang", "0.5.16", ensure_installed),  # ragged verify's first release
    ("sglang", "0.5.7", ensure_installed),  # the oldest release with the multi-layer draft-extend runner
    ("vllm", "0.34.0", ensure_vllm_installed),  # vLLM's newest checked release
    ("vllm", "0.33.0", ensure_vllm_installed),  # the newest token-keyed one
    ("vllm-ascend", "0.23.0.post1", ensure_ascend_installed),  # and the vLLM release it runs on
)


def main() -> int:
    failed = 0
    for engine, version, install in RELEASES:
        start = time.monotonic()
        try:
            path = install(version, log=lambda msg: None)
        except InstallError as e:
            failed += 1
            print(f"{engine}=={version}: not installed: {e}", flush=True)
            continue
        print(f"{engine}=={version}: {path} ({time.monotonic() - start:.1f} s)", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
