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


def eager_vs_graph(device: str, dtype: str) -> Optional[Tol]:
    return EAGER_VS_GRAPH.get((device, dtype), EAGER_VS_GRAPH[("cuda", "bfloat16")])


def cross_layout(dtype: str) -> Tol:
    return CROSS_LAYOUT[dtype]
