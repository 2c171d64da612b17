"""ParallelLayout derives the engine's flags (DESIGN.md §6.1); expectations written by hand from the spec."""
import pytest

from harness.layout import all_layouts, branch_sibling, layouts_by_branch
from runners.parallel.comm import Group
from runners.parallel.layout import Branch, LayoutError
from runners.parallel.layout import ParallelLayout as PL

# (layout, attn_tp_size, require_mlp_tp_gather, require_attn_tp_gather, branch) — from the §6.1 rules
TABLE = [
    (PL(1), 1, False, False, Branch.NEITHER),
    (PL(4), 4, False, False, Branch.NEITHER),
    (PL(4, moe_a2a_backend="deepep"), 4, False, True, Branch.ATTN_TP_GATHER),  # (i) a2a, no DP attention
    (PL(4, moe_dense_tp_size=1), 4, False, True, Branch.ATTN_TP_GATHER),  # (i) dense TP 1
    (PL(4, 2, True), 2, True, False, Branch.MLP_TP_GATHER),  # DP attention, default flags
    (PL(8, 4, True, enable_dp_lm_head=True), 2, True, False, Branch.MLP_TP_GATHER),  # dense unset -> mlp
    (PL(4, 2, True, 1, False, "deepep"), 2, True, True, Branch.MLP_TP_GATHER),  # no dp lm head -> mlp wins
    (PL(4, 2, True, 1, True, "none"), 2, True, True, Branch.MLP_TP_GATHER),  # no a2a -> mlp
    (PL(4, 2, True, 1, True, "deepep"), 2, False, True, Branch.ATTN_TP_GATHER),  # (ii)
    (PL(4, 4, True, 1, True, "deepep"), 1, False, False, Branch.NEITHER),  # dp == tp with (ii)'s flags
    (PL(8, 8, True, 1, True, "deepep"), 1, False, False, Branch.NEITHER),
]


@pytest.mark.parametrize("layout,attn_tp,mlp,attn,branch", TABLE, ids=lambda x: x.describe() if isinstance(x, PL) else None)
def test_derived_flags(layout, attn_tp, mlp, attn, branch):
    assert layout.attn_tp_size == attn_tp
    assert layout.require_mlp_tp_gather is mlp
    assert layout.require_attn_tp_gather is attn
    assert layout.require_gathered_buffer is (mlp or attn)
    assert layout.branch is branch


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(tp_size=4, dp_size=3, enable_dp_attention=True), "layout.dp_size"),
        (dict(tp_size=4, dp_size=1, enable_dp_attention=True), "layout.enable_dp_attention"),
        (dict(tp_size=4, dp_size=2), "layout.dp_size"),
        (dict(tp_size=4, moe_dense_tp_size=2), "layout.moe_dense_tp_size"),
        (dict(tp_size=4, moe_a2a_backend="nccl-magic"), "layout.moe_a2a_backend"),
        (dict(tp_size=16), "layout.tp_size"),
        (dict(tp_size=2, enable_dp_lm_head=True), "layout.enable_dp_lm_head"),
    ],
)
def test_impossible_layouts_name_field_and_rule(kwargs, field):
    with pytest.raises(LayoutError) as e:
        PL(**kwargs)
    assert str(e.value).startswith(field + ":")


def test_groups_partition_world():
    layout = PL(8, 4, True)
    assert layout.group_ranks(Group.ATTN_TP, 5) == [4, 5]
    assert layout.group_ranks(Group.ATTN_DP, 5) == [1, 3, 5, 7]
    assert layout.group_ranks(Group.WORLD, 5) == list(range(8))
    for r in range(8):
        assert r in layout.group_ranks(Group.ATTN_TP, r) and r in layout.group_ranks(Group.ATTN_DP, r)


def test_every_branch_reachable_at_several_world_sizes():
    groups = layouts_by_branch()
    for branch in Branch:
        assert {layout.tp_size for layout in groups[branch]} >= {2, 4, 8}, branch
    assert len(all_layouts()) == sum(len(v) for v in groups.values())


def test_branch_sibling_flips_gathered_branch():
    sib = branch_sibling(PL(4, 2, True))
    assert sib is not None and sib.branch is Branch.ATTN_TP_GATHER and (sib.tp_size, sib.dp_size) == (4, 2)
    assert branch_sibling(PL(4)) is None
