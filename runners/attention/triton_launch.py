"""Where the runners' Triton kernels run: on the GPU, or without CUDA in Triton's interpreter.

TRITON_INTERPRET=1 must be set before triton is first imported (triton.language's own helpers
are decorated at import), so importing this module on a machine without CUDA sets it when
triton isn't imported yet; `interpreter_error()` says why kernels can't run when it was.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Optional

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the only way triton runs without a GPU

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from runners.attention.triton_interpreter import speed_up_interpreter  # noqa: E402

__all__ = ["INTERPRET", "interpreter_error", "run_kernel", "tl", "triton"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if INTERPRET:
    speed_up_interpreter()
_INTERPRETER_LOCK = threading.Lock()  # the interpreter patches triton.language globally: one launch at a time


def interpreter_error(device: torch.device) -> Optional[str]:
    """None when kernels can run on `device`; else the reason (for errors and test skips)."""
    if device.type == "cuda" or INTERPRET:
        return None
    return ("the triton backend on CPU runs in Triton's interpreter, which needs TRITON_INTERPRET=1 set before triton is "
            "first imported; triton was imported without it in this process")


def run_kernel(kernel, grid: tuple[int, ...], *args, **meta) -> None:
    if INTERPRET:
        with _INTERPRETER_LOCK:
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)
