"""triton and flashinfer are optional packages (pyproject lists torch and numpy): importing the runners, the
pytest plugin an engine team loads (`-p harness.plugin`) or the mutant catalog must import neither, and must not
leave TRITON_INTERPRET set (runners/attention/triton_launch.py sets it on CPU before triton's first import).

Each case runs in a fresh interpreter: this process has imported triton long before (other tests, conftest)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = {
    # the multi-layer runner, the loop and its harness import the fused fill (and triton) only on the fused path
    "runners": ("runners.draft_extend_graph_driver", "runners.spec_decode", "harness.run.loop"),
    # the catalog names the triton backend's and the fused fill's code by string, imported when a mutant is planted
    "plugin-and-catalog": ("harness.plugin.cases", "harness.mutants"),
}


@pytest.mark.parametrize("modules", CASES.values(), ids=CASES.keys())
def test_imports_without_the_optional_packages(modules: tuple[str, ...]):
    code = (f"import os, sys\nimport {', '.join(modules)}\n"
            "print('triton' in sys.modules, 'flashinfer' in sys.modules, 'TRITON_INTERPRET' in os.environ)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(__file__).parent.parent, capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.split() == ["False", "False", "False"], done.stdout + done.stderr
