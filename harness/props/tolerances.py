"""Tolerances per dtype and per comparison, each with the reason it is what it is.

(rtol, atol) pairs for torch.testing.assert_close; None means bitwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Tol:
    rtol: float
    atol: float
    reason: str


# P3, eager vs graph on the same layout: the graph runs the same code on the same real rows,
# but on a padded batch (bucket bs >= raw_bs; in the MLP branch every DP group padded to the
# same length). The GEMMs then have another M, and oneDNN/MKL on CPU (cuBLAS on GPU) pick
# another blocking, which reorders the K reduction. Measured on CPU fp32 over the default
# grid: max |diff| 2.4e-6 on logits of magnitude ~3, 0 at TP1 where nothing is reduced
# across ranks. So: a few fp32 ulps of the accumulation, far below the O(1) error of a
# wrong or missing row. Where M is the same (raw_bs == bs, no DP padding) the paths are
# bitwise equal; tests/test_graph_runner.py asserts that separately.
# Measured on the H200 (tests/test_gpu.py, real CUDA graphs, tp1 both branches, 2026-12-02):
# fp32 max |diff| 2.4e-6 on logits (torch and triton backends, TF32 off); bf16 0 (bitwise:
# cuBLAS picked the same reduction for every M here). The bounds stay at the CPU ones.
EAGER_VS_GRAPH: dict[tuple[str, str], Optional[Tol]] = {
    ("cpu", "float32"): Tol(1e-5, 1e-5, "GEMM blocking depends on the padded M: fp32 accumulation reorder"),
    ("cpu", "bfloat16"): Tol(1.6e-2, 1e-2, "bf16 rounding after a reordered fp32 accumulation: 1 bf16 ulp relative"),
    ("cuda", "float32"): Tol(1e-5, 1e-5, "cuBLAS kernel choice depends on M; fp32 accumulation reorder, TF32 disabled"),
    ("cuda", "bfloat16"): Tol(1.6e-2, 1e-2, "bf16 outputs round after a reordered fp32 accumulation: 1 bf16 ulp (2^-7) relative"),
}

# P4, a layout vs TP1: TP shards reorder the sums of attention heads (o_proj all-reduce),
# of the MLP intermediate (row-parallel all-reduce) and of the vocab-parallel lm_head
# never (each logit is one dot product). Three layers deep in fp32 the reorder error
# measured stays below 2e-6 absolute on logits of magnitude ~3; 1e-4 leaves headroom
# without hiding a single misplaced row (errors from a wrong row are O(1)).
CROSS_LAYOUT: dict[str, Tol] = {
    "float32": Tol(1e-4, 1e-4, "fp32 TP reduction reorder across <= 8 shards, 3 layers deep; wrong rows are O(1)"),
    "bfloat16": Tol(5e-2, 5e-2, "bf16 rounding of partial sums at each all-reduce (8 shards), 3 layers deep"),
    "float16": Tol(1e-2, 1e-2, "fp16 rounding of partial sums at each all-reduce"),
}


# Per attention backend, where it differs from the torch reference's numbers above. flashinfer
# has no fp32 kernels: an fp32 model runs its attention in bf16 (q and KV cast, output cast
# back). A one-ulp fp32 difference upstream (the padded-M GEMMs of P3) then flips a bf16
# rounding of q/k/v now and then, and the attention output moves by ~1 bf16 ulp (2^-8
# relative) of the values it averages: fp32 comparisons through flashinfer get bf16's bound.
# Measured on the H200: step 0 of an iteration 1.4e-6 (no flip yet), later steps up to 1.8e-3 on
# logits (2.2e-3 on hidden states): 5x below the bound; a wrong row is O(1).
BACKEND_EAGER_VS_GRAPH: dict[tuple[str, str, str], Optional[Tol]] = {
    ("cuda", "float32", "flashinfer"): Tol(1.6e-2, 1e-2, "flashinfer attention runs in bf16 for an fp32 model: bf16 rounding flips"),
}
BACKEND_CROSS_LAYOUT: dict[tuple[str, str], Tol] = {
    ("float32", "flashinfer"): Tol(5e-2, 5e-2, "flashinfer attention runs in bf16 for an fp32 model (as bfloat16 below)"),
}

# An attention backend's kernels vs the torch reference on the same paged KV cache (unit
# tests, tests/test_triton_backend.py and tests/test_gpu.py). The kernels use an online
# softmax over key blocks with fp32 accumulators; the reference computes all scores, one
# softmax in fp32 and the weighted sum in the model dtype. fp32: reassociated sums of <= 64
# terms, a few ulps of O(1) values. bf16: the reference rounds the scores and the probs to
# bf16 (2^-8 relative each) where the kernels don't, so a few bf16 ulps of the output.
# Measured (outputs of magnitude <= ~2): CPU interpreter fp32 triton 3.6e-7; H200 fp32 triton
# 4.8e-7, bf16 triton and flashinfer 7.8e-3 (one bf16 ulp at 1..2), flashinfer on fp32 7.0e-3.
ATTN_VS_REFERENCE: dict[str, Tol] = {
    "float32": Tol(2e-5, 2e-5, "online softmax over key blocks vs one softmax: reassociated fp32 sums"),
    "bfloat16": Tol(3e-2, 3e-2, "the reference rounds scores and probs to bf16, the kernels accumulate in fp32"),
    "float16": Tol(5e-3, 5e-3, "the reference rounds scores and probs to fp16, the kernels accumulate in fp32"),
}
# flashinfer on an fp32 model computes in bf16 (see above): the output is q/k/v rounded to bf16, then attended.
FLASHINFER_FP32_VS_REFERENCE = Tol(3e-2, 3e-2, "flashinfer has no fp32 kernels: q/k/v rounded to bf16 (2^-8) before attention")

# The CPU simulation vs the real CUDA graph (tests/test_gpu.py): same case, same host metadata
# (compared exactly), tensors from two devices: MKL/oneDNN vs cuBLAS GEMMs and two softmax
# implementations, three layers deep. fp32: as cross-layout (the reorder error is of the same
# kind); bf16: rounding of different partial sums at every GEMM, as cross-layout bf16.
# Measured (H200 real graph vs CPU simulation with the torch backend): fp32 3.0e-6 (torch,
# triton), flashinfer-on-fp32 9.2e-3 (its bf16 attention, under its 5e-2 bound); bf16 step 0
# 1.6e-2..3.1e-2 (1-2 bf16 ulps of logits ~3), later steps up to 3.5e-2; with the triton
# backend in bf16 three iterations flipped a top-1 tie within the bound (compare_outputs notes
# it and stops comparing that iteration: the inputs of later steps differ from there on).
# The simulated graph on the GPU vs the real graph: bitwise equal in every case measured.
CROSS_DEVICE: dict[str, Tol] = {
    "float32": Tol(1e-4, 1e-4, "CPU vs GPU kernels: fp32 reduction order, 3 layers deep"),
    "bfloat16": Tol(5e-2, 5e-2, "CPU vs GPU kernels: bf16 rounding of differently ordered partial sums"),
}


def eager_vs_graph(device: str, dtype: str, backend: str = "torch") -> Optional[Tol]:
    if (device, dtype, backend) in BACKEND_EAGER_VS_GRAPH:
        return BACKEND_EAGER_VS_GRAPH[(device, dtype, backend)]
    return EAGER_VS_GRAPH.get((device, dtype), EAGER_VS_GRAPH[("cuda", "bfloat16")])


def cross_layout(dtype: str, backend: str = "torch") -> Tol:
    return BACKEND_CROSS_LAYOUT.get((dtype, backend), CROSS_LAYOUT[dtype])


def attn_vs_reference(dtype: str, backend: str = "triton", model_dtype: Optional[str] = None) -> Tol:
    if backend == "flashinfer" and (model_dtype or dtype) == "float32":
        return FLASHINFER_FP32_VS_REFERENCE
    return ATTN_VS_REFERENCE[dtype]


def cross_device(dtype: str, backend: str = "torch") -> Tol:
    if backend == "flashinfer" and dtype == "float32":
        return BACKEND_CROSS_LAYOUT[("float32", "flashinfer")]
    return CROSS_DEVICE[dtype]
