"""Build a Triton kernel's CUDA front end (TTIR) on a machine without a GPU, from the arguments of a real launch.

Triton's interpreter runs a kernel's Python body, so it accepts code that the GPU compiler refuses (a name
typed differently across the branches of an if, a block shape that is not a power of two). The front end
needs no device: tests/test_triton_ttir.py records every launch of the CPU suite's kernels in the interpreter
(`record`), and hands the records to this module in a fresh process without the interpreter (`python
tests/helpers/triton_ttir.py RECORDS.json`), where the kernels are compiled ones and `ASTSource.make_ir` builds TTIR
for an sm_90 target (the H200's).
"""
from __future__ import annotations

import importlib
import json
import sys
from typing import Any

import torch
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource

# torch dtype -> Triton's pointer element type in a signature
POINTER = {torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.bool: "i1",
           torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def record(kernel: Any, args: tuple, meta: dict) -> dict:
    """One launch as JSON: the kernel's module and name, each argument's kind (a pointer's element type, a scalar's value)."""
    values: dict[str, list] = {}
    for name, value in [*zip(kernel.arg_names, args, strict=False), *meta.items()]:
        if isinstance(value, torch.Tensor):
            values[name] = ["pointer", POINTER[value.dtype]]
        elif isinstance(value, bool):
            values[name] = ["bool", value]
        elif isinstance(value, int):
            values[name] = ["int", value]
        elif isinstance(value, float):
            values[name] = ["float", value]
        else:
            raise TypeError(f"{kernel.fn.__name__}: argument {name} is a {type(value).__name__}, which the record does not know")
    return {"module": kernel.fn.__module__, "kernel": kernel.fn.__name__, "values": values}


def build_ttir(rec: dict) -> str:
    """TTIR of the recorded launch for sm_90; raises Triton's CompilationError where the GPU compiler would."""
    kernel = getattr(importlib.import_module(rec["module"]), rec["kernel"])
    signature, constexprs = {}, {}
    for i, p in enumerate(kernel.params):
        kind, value = rec["values"].get(p.name, ["default", p.default])
        if p.is_constexpr:
            signature[p.name], constexprs[(i,)] = "constexpr", value
        elif kind == "pointer":
            signature[p.name] = "*" + value
        elif kind == "bool":
            signature[p.name] = "i1"
        elif kind == "int":
            signature[p.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif kind == "float":
            signature[p.name] = "fp32"
        else:
            raise ValueError(f"{rec['kernel']}: no recorded value for its argument {p.name}")
    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    module = source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    return str(module)


def main(path: str) -> int:
    with open(path) as f:
        records = json.load(f)
    failed = 0
    for rec in records:
        try:
            build_ttir(rec)
            print(f"ok {rec['module']}.{rec['kernel']}")
        except Exception as e:  # every kernel is reported, then the exit status says whether any failed
            failed += 1
            print(f"FAILED {rec['module']}.{rec['kernel']}: {type(e).__name__}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
