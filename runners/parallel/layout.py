"""ParallelLayout: the server-args slice that decides how a draft step is sharded.

The derived flags follow the engine exactly: the graph runner's
`get_forward_batch` has one branch per outcome, and the seed bug lived in one of them,
so getting the derivation wrong would test the wrong branch.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from runners.parallel.comm import Group


class LayoutError(ValueError):
    """An impossible layout; the message names the field and the rule it breaks."""


class Branch(str, Enum):
    """Which arm of get_forward_batch(bs) a layout takes (MLP is tested first)."""

    MLP_TP_GATHER = "mlp_tp_gather"
    ATTN_TP_GATHER = "attn_tp_gather"
    NEITHER = "neither"


class DpPaddingMode(str, Enum):
    MAX_LEN = "max_len"  # every DP rank padded to the longest; buffer = max * dp
    SUM_LEN = "sum_len"  # ranks concatenated; buffer = sum of lengths


A2A_BACKENDS = ("none", "deepep", "mooncake", "flashinfer")


@dataclass(frozen=True)
class ParallelLayout:
    tp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    moe_dense_tp_size: Optional[int] = None  # None: dense layers TP over the whole tp group
    enable_dp_lm_head: bool = False
    moe_a2a_backend: str = "none"
    enable_two_batch_overlap: bool = False

    def __post_init__(self) -> None:
        def bad(field: str, rule: str) -> LayoutError:
            return LayoutError(f"layout.{field}: {rule} (got {self})")

        if self.tp_size < 1:  # the upper bound is the model's: runners.model.check_model_fits_layout
            raise bad("tp_size", "must be >= 1")
        if self.dp_size < 1:
            raise bad("dp_size", "must be >= 1")
        if self.tp_size % self.dp_size:
            raise bad("dp_size", f"tp_size ({self.tp_size}) must be divisible by dp_size ({self.dp_size})")
        if self.enable_dp_attention and self.dp_size == 1:
            raise bad("enable_dp_attention", "DP attention needs dp_size > 1")
        if self.dp_size > 1 and not self.enable_dp_attention:
            raise bad("dp_size", "dp_size > 1 needs enable_dp_attention (data-parallel attention)")
        if self.moe_a2a_backend not in A2A_BACKENDS:
            raise bad("moe_a2a_backend", f"must be one of {A2A_BACKENDS}")
        if self.moe_dense_tp_size is not None and self.moe_dense_tp_size < 1:
            raise bad("moe_dense_tp_size", "must be unset or >= 1")
        if self.moe_dense_tp_size not in (None, 1, self.tp_size):
            raise bad(
                "moe_dense_tp_size",
                f"must be unset, 1 or tp_size ({self.tp_size}): the draft model's dense MLP is TP over all ranks or replicated",
            )
        if self.moe_dense_tp_size not in (None, 1) and self.moe_a2a_backend != "none":
            raise bad("moe_dense_tp_size", "an attn-TP gather (all-to-all backend) needs moe_dense_tp_size in {1, unset}")
        if self.enable_dp_lm_head and not self.enable_dp_attention:
            raise bad("enable_dp_lm_head", "only meaningful with enable_dp_attention")

    # ---- sizes ----
    @property
    def world_size(self) -> int:
        return self.tp_size

    @property
    def attn_dp_size(self) -> int:
        return self.dp_size if self.enable_dp_attention else 1

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size // self.attn_dp_size

    def attn_tp_rank(self, tp_rank: int) -> int:
        return tp_rank % self.attn_tp_size

    def attn_dp_rank(self, tp_rank: int) -> int:
        return tp_rank // self.attn_tp_size

    @property
    def dense_tp_size(self) -> int:
        """Ranks the dense MLP is sharded over (moe_dense_tp_size unset: all)."""
        return self.tp_size if self.moe_dense_tp_size is None else self.moe_dense_tp_size

    @property
    def mlp_replicated(self) -> bool:
        """Dense MLP weights whole on every rank (moe_dense_tp_size == 1, or tokens scattered in the attn-TP branch)."""
        return self.dense_tp_size == 1 or self.branch is Branch.ATTN_TP_GATHER

    # ---- derived flags ----
    @property
    def require_mlp_tp_gather(self) -> bool:
        if not self.enable_dp_attention:
            return False
        return (
            self.moe_dense_tp_size is None
            or not self.enable_dp_lm_head
            or self.moe_a2a_backend == "none"
            or self.moe_dense_tp_size > self.tp_size // self.dp_size
        )

    @property
    def require_attn_tp_gather(self) -> bool:
        if self.moe_dense_tp_size not in (None, 1):
            return False
        scatter = self.moe_a2a_backend != "none" or self.moe_dense_tp_size == 1
        return scatter and (not self.enable_dp_attention or self.dp_size < self.tp_size)

    @property
    def require_gathered_buffer(self) -> bool:
        return self.require_mlp_tp_gather or self.require_attn_tp_gather

    @property
    def require_mlp_sync(self) -> bool:
        return self.enable_dp_attention or self.require_gathered_buffer

    @property
    def branch(self) -> Branch:
        if self.require_mlp_tp_gather:
            return Branch.MLP_TP_GATHER
        if self.require_attn_tp_gather:
            return Branch.ATTN_TP_GATHER
        return Branch.NEITHER

    @property
    def dp_padding_mode(self) -> DpPaddingMode:
        """Draft-extend graphs always pad every DP rank to the same bucket."""
        return DpPaddingMode.MAX_LEN

    @property
    def logits_dp_gather(self) -> bool:
        """The logits processor's cross-DP gather before lm_head."""
        return not self.enable_dp_lm_head and self.tp_size > 1 and self.attn_dp_size != 1

    @property
    def capture_bs_base(self) -> int:
        base = self.attn_tp_size if self.require_gathered_buffer else 1
        return base * (2 if self.enable_two_batch_overlap else 1)

    # ---- groups ----
    def group_ranks(self, group: Group, tp_rank: int) -> list[int]:
        a = self.attn_tp_size
        if group is Group.WORLD:
            return list(range(self.tp_size))
        if group is Group.ATTN_TP:
            d = self.attn_dp_rank(tp_rank)
            return list(range(d * a, (d + 1) * a))
        if group is Group.ATTN_DP:
            return list(range(self.attn_tp_rank(tp_rank), self.tp_size, a))
        raise KeyError(group)

    def describe(self) -> str:
        flags = [f"tp{self.tp_size}"]
        if self.enable_dp_attention:
            flags.append(f"dp{self.dp_size}")
        if self.moe_dense_tp_size is not None:
            flags.append(f"dense_tp{self.moe_dense_tp_size}")
        if self.enable_dp_lm_head:
            flags.append("dp_lm_head")
        if self.moe_a2a_backend != "none":
            flags.append(f"a2a_{self.moe_a2a_backend}")
        return "-".join(flags) + f" [{self.branch.value}]"
