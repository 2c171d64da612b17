"""Which of a release's device paths a run checks, and with which fill code each (layout, DP group) replays.

SGLang's device-specific code on the draft-extend path is prepare()'s fill: from 0.5.16 a fused
Triton kernel, from 0.5.17 also its native twin, which the runner module swaps in on NPUs
(`if is_npu(): fill_draft_extend_prepare_buffers = ..._native`). The worker builds the one-graph
composite only off NPU (`if not _is_npu` in _capture_cuda_graphs, 0.5.16 on). Everything else
driven (the Python fills, the single-layer runner, the draft decode, the target verify graphs)
is the same code on both devices: its lines carry no path and every run checks them.

* GPU path: the kernel fills every replay; the one graph is built.
* NPU path: the twin fills every replay; no one graph.
* both (the default): the kernel fills the first DP group of KERNEL_LAYOUTS (interpreted: slow),
  with the twin run beside it on clones of the same buffers (the same inputs), and the twin fills
  every other replay; the report says where the kernel did not run.

A release with the kernel and no twin (0.5.16) runs the kernel on both devices: its per-step
composite's lines carry no path, and only the one graph is GPU-only.
"""
from __future__ import annotations

from dataclasses import dataclass

from harness.engines.options import ALL_PATHS, FillPath
from harness.engines.sglang.fill import FillObserver
from runners.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class FillPlan:
    kernel: bool  # the release fills with prepare()'s Triton kernel
    twin: bool  # ... and ships its native twin, the NPU's fill
    paths: frozenset[FillPath]
    kernel_layouts: tuple[ParallelLayout, ...]

    @classmethod
    def of(cls, fill: FillObserver | None, paths: frozenset[FillPath], kernel_layouts: tuple[ParallelLayout, ...]) -> "FillPlan":
        return cls(fill is not None, fill is not None and fill.native is not None, paths, kernel_layouts)

    @property
    def one_graph(self) -> bool:
        """The one-graph composite (GPU only) is checked."""
        return FillPath.GPU in self.paths

    def kernel_fills(self, layout: ParallelLayout, d: int) -> bool:
        """The kernel fills (layout, DP group d)'s real buffers (else the twin does, where the release has one)."""
        if not self.twin:
            return self.kernel
        if self.paths == ALL_PATHS:
            return d == 0 and layout in self.kernel_layouts
        return FillPath.GPU in self.paths

    def twin_beside(self, kernel_fills: bool) -> bool:
        """The twin runs beside the kernel on clones (its lanes a second, NPU-path record of the same replay)."""
        return self.twin and kernel_fills and FillPath.NPU in self.paths

    def apply(self, fill: FillObserver | None, kernel_fills: bool) -> None:
        if fill is not None:
            fill.kernel, fill.beside = kernel_fills, self.twin_beside(kernel_fills)

    def line_path(self, kernel_fills: bool) -> str:
        """The path of the per-step composite's lines on a replay the kernel (or the twin) filled."""
        if not self.twin:
            return ""
        return FillPath.GPU.value if kernel_fills else FillPath.NPU.value

    @property
    def one_graph_path(self) -> str:
        return FillPath.GPU.value

    def header(self, version: str) -> str:
        """The report's `path:` line: what each checked path ran, and what was left out, with why."""
        if not self.kernel:
            return f"path: gpu, npu: sglang {version}'s draft-extend fills are Python, the same code on both (checked once, no path)"
        if not self.twin:
            left = "" if self.one_graph else " (gpu not checked: the one-graph composite, built only off NPU, was left out)"
            return (f"path: {self._names()}: sglang {version} fills with prepare()'s Triton kernel on both devices (its lines carry no "
                    f"path); the one-graph composite is GPU-only{left}")
        if self.paths == ALL_PATHS:
            where = ", ".join(lay.describe().split(" [")[0] for lay in self.kernel_layouts)
            return (f"path: gpu, npu (gpu: prepare()'s Triton kernel, interpreted, on the first DP group of {where}, with the native "
                    "twin beside it on the same inputs; npu: the twin on every other replay; --path gpu runs the kernel everywhere)")
        (only,) = self.paths
        other = FillPath.NPU if only is FillPath.GPU else FillPath.GPU
        what = "prepare()'s Triton kernel on every replay" if only is FillPath.GPU else "prepare()'s native twin on every replay, no one graph"
        return f"path: {only.value}: {what} ({other.value} not checked: --path {only.value})"

    def skipped(self, layouts: tuple[ParallelLayout, ...]) -> list[str]:
        """What the plan leaves unchecked, for the report's `skipped` (never a pass)."""
        out = []
        if self.kernel and not self.one_graph:
            out.append("multi_layer_1g (the one-graph composite): not checked: it is built only off NPU and this run checks --path npu")
        if self.twin and FillPath.NPU not in self.paths:
            out.append("npu path (prepare()'s native fill twin, multi_layer): not checked: --path gpu")
        if self.twin and FillPath.GPU not in self.paths:
            out.append("gpu path (prepare()'s Triton fill kernel, multi_layer): not checked: --path npu")
        if self.twin and self.paths == ALL_PATHS:
            rest = [lay.describe().split(" [")[0] for lay in layouts if lay not in self.kernel_layouts]
            if rest:
                out.append(f"gpu path (prepare()'s Triton fill kernel) of multi_layer on {', '.join(rest)} and on DP groups past the "
                           "first: not run (interpreted, slow: the native twin fills there); --path gpu runs it on every replay")
        return out

    def _names(self) -> str:
        return ", ".join(sorted(p.value for p in self.paths))
