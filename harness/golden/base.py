"""Shared by every part of the golden lifecycle: the shipped directory, the format, the fields, the errors."""
from __future__ import annotations

from enum import StrEnum
from pathlib import Path

from harness.cases.data import shipped_dir
from harness.props.tolerances import Tol

GOLDEN_DIR = shipped_dir("golden")
FORMAT = "specharness-golden/1"


class GoldenKind(StrEnum):
    """What a golden records; every kind goes through the same record / check / report lifecycle."""

    ARRAYS = "arrays"  # golden/<case>.npz + .json: one graph run's metadata and outputs, per rank, iteration, step
    ACCEPTANCE = "acceptance"  # golden/acceptance/<case>.json: the loop's accept lengths (P6)
    DRAFT_TREE = "draft-tree"  # golden/acceptance/<case>.draft_tree.json: the single-layer draft decode's trees (P6)
    LOGPROBS = "logprobs"  # golden/acceptance/<case>.logprobs.json: the loop's returned logprobs (P6)

# Record and check run the same fp32 CPU code: bitwise equal on one machine. Across CPUs, MKL /
# oneDNN pick other kernels (AVX2 vs AVX-512) and reorder fp32 sums: a few ulps on logits of
# magnitude ~3, three layers deep, as for eager vs graph (harness/props/tolerances.py EAGER_VS_GRAPH).
# Errors from a wrong or misplaced row are O(1). A case overrides these in [tolerances.golden].
DEFAULT_TOLERANCES: dict[str, Tol] = {
    "logits": Tol(1e-5, 1e-5, "fp32 accumulation reorder across CPU kernels; wrong rows are O(1)"),
    "logprobs": Tol(1e-5, 1e-5, "log_softmax of the logits above"),
    "hidden": Tol(1e-5, 1e-5, "fp32 accumulation reorder across CPU kernels"),
    "topk_p": Tol(1e-5, 1e-5, "exp of the logprobs above"),
}
INT_FIELDS = ("topk_index", "next_input_ids")
# Per step, every metadata int in one packed vector `r.i.s.meta`: for each field in this order, its
# length then its values (length -1: None, no gathered buffer in this branch). One array instead of
# fifteen keeps the .npz small (each entry costs ~250 bytes of zip and npy headers).
# Named as in harness.run.records.ReplayRecord (capture.<field>: its CaptureRecord; the host lists under their ForwardBatch names).
META_FIELDS = ("graph_replayed", "raw_bs", "bs", "num_tokens", "global_num_tokens_cpu", "global_num_tokens_for_logprob_cpu",
               "global_dp_buffer_len", "capture.global_num_tokens_gpu", "capture.global_num_tokens_for_logprob_gpu",
               "global_num_tokens_gpu", "global_num_tokens_for_logprob_gpu", "padded_seq_lens", "seq_lens_sum", "rows_fed", "logits_rows")
PAUSE_ENV = "SPECHARNESS_GOLDEN_TEST_PAUSE"  # "<point>:<seconds>", point in {written, between}: tests kill record there


class GoldenError(Exception):
    """A user-facing golden problem (missing, refused, inconsistent): a message, never a traceback."""


class GoldenFormatError(GoldenError):
    """A golden file that is not one (wrong JSON shape, object arrays, not a regular file): bad input, exit 2."""


def show(path) -> str:
    """A path as a user wants to read it: relative to the working directory when inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)

