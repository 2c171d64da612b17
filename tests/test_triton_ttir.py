"""Every Triton kernel of runners/ builds its CUDA front end on this (GPU-less) machine, as the CPU suite launches it.

The CPU suite runs the kernels in Triton's interpreter, which executes their Python and so accepts code the
GPU compiler refuses; a GPU run is the first to see such a kernel fail. Here each kernel is launched once
for real (interpreter, small inputs), its launch recorded, and its TTIR for sm_90 built from the record in a
fresh process without the interpreter (tests/helpers/triton_ttir.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.6.0)")
import runners.attention.flashinfer_kv_indices as kv_indices_module  # noqa: E402
import runners.attention.triton_backend as triton_backend  # noqa: E402
import runners.draft_extend_fill as fill_module  # noqa: E402
from runners.batch import ForwardMode  # noqa: E402
from runners.draft_extend import DraftExtendInputs  # noqa: E402
from runners.memory import LanePadding  # noqa: E402
from tests.helpers import triton_ttir  # noqa: E402
from tests.test_draft_extend_fill import _tiny_buffers  # noqa: E402
from tests.test_triton_backend import paged_batch, run_both  # noqa: E402

HERE = Path(__file__).parent
LAUNCHING_MODULES = (fill_module, kv_indices_module, triton_backend)  # every module of runners/ that calls run_kernel


@pytest.fixture
def launches(monkeypatch) -> list[dict]:
    records: list[dict] = []
    for module in LAUNCHING_MODULES:
        real = module.run_kernel

        def recording(kernel, grid, *args, real=real, **meta):
            records.append(triton_ttir.record(kernel, args, meta))
            real(kernel, grid, *args, **meta)

        monkeypatch.setattr(module, "run_kernel", recording)
    return records


def _build(records: list[dict], tmp_path: Path, *path: Path) -> subprocess.CompletedProcess:
    """tests/helpers/triton_ttir.py over `records` in a fresh process without the interpreter; `path` adds kernels' modules."""
    launches = tmp_path / "launches.json"
    launches.write_text(json.dumps(records))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(map(str, [*path, HERE.parent, HERE]))}
    return subprocess.run([sys.executable, str(HERE / "helpers" / "triton_ttir.py"), str(launches)], env=env, capture_output=True, text=True,
                          timeout=300)


def _launch_every_kernel() -> None:
    buffers = _tiny_buffers()
    inp = DraftExtendInputs(torch.tensor([5, 6, 7, 8]), torch.tensor([3, 4, 4, 5]), torch.tensor([5, 6]), torch.tensor([2, 3]),
                            torch.ones(4, 2), torch.tensor([2, 1]), [2])
    fill_module.fill_prepare_buffers(buffers, inp, 3, 2, LanePadding(0, 0))
    req_to_token = torch.arange(40, dtype=torch.int32).view(4, 10)
    kv_indices_module.write_kv_indices(torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([1, 2]), req_to_token,
                                       torch.zeros(8, dtype=torch.int32), 1, None, 0)
    run_both(*paged_batch([5, 20], 4, 8, 2, 8))  # the extend kernel
    run_both(*paged_batch([3, 11], 1, 8, 2, 8, mode=ForwardMode.DECODE))  # the decode kernel


def test_every_kernel_builds_its_cuda_front_end(launches, tmp_path):
    _launch_every_kernel()
    kernels = {(r["module"], r["kernel"]) for r in launches}
    assert kernels == {("runners.draft_extend_fill", "_prepare_fill_kernel"),
                       ("runners.attention.flashinfer_kv_indices", "_kv_indices_kernel"),
                       ("runners.attention.triton_backend", "_extend_kernel"), ("runners.attention.triton_backend", "_decode_kernel")}
    unique = list({json.dumps(r, sort_keys=True): r for r in launches}.values())
    done = _build(unique, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_kernel_the_gpu_compiler_refuses_is_caught(tmp_path):
    """The check can fail: a kernel whose mask name changes shape between an if's branches (the interpreter runs it)."""
    (tmp_path / "refused_kernel.py").write_text(
        "import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef refused(x, n, A: tl.constexpr, B: tl.constexpr):\n"
        "    pid = tl.program_id(0)\n    if pid == 0:\n        m = tl.arange(0, A) < n\n        tl.store(x + tl.arange(0, A), 1, mask=m)\n"
        "    else:\n        m = tl.arange(0, B) < n\n        tl.store(x + tl.arange(0, B), 2, mask=m)\n")
    rec = {"module": "refused_kernel", "kernel": "refused", "values": {"x": ["pointer", "i64"], "n": ["int", 3], "A": ["int", 8], "B": ["int", 16]}}
    done = _build([rec], tmp_path, tmp_path)
    assert done.returncode == 1 and "FAILED refused_kernel.refused: CompilationError" in done.stdout, done.stdout + done.stderr
