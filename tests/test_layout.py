"""ParallelLayout derives the branch flags as the engine does; expectations written by hand."""
import pytest

from harness.run.layouts import all_layouts, branch_sibling, deployed_layouts, layouts_by_branch
from runners.config import DEFAULT_MODEL
from runners.model import check_model_fits_layout
from runners.parallel.comm import Group
from runners.parallel.layout import Branch, LayoutError
from runners.parallel.layout import ParallelLayout as PL

# (layout, attn_tp_size, require_mlp_tp_gather, require_attn_tp_gather, branch) — by hand
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
    # multi-node DP-attention deployments
    (PL(16, 16, True), 1, True, False, Branch.MLP_TP_GATHER),
    (PL(32, 8, True, 1, True, "deepep"), 4, False, True, Branch.ATTN_TP_GATHER),  # (ii) across 4 nodes
    (PL(64, 8, True), 8, True, False, Branch.MLP_TP_GATHER),
    (PL(64, 64, True, 1, True, "deepep"), 1, False, False, Branch.NEITHER),
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
        (dict(tp_size=0), "layout.tp_size"),
        (dict(tp_size=32, dp_size=3, enable_dp_attention=True), "layout.dp_size"),
        (dict(tp_size=2, enable_dp_lm_head=True), "layout.enable_dp_lm_head"),
    ],
)
def test_impossible_layouts_name_field_and_rule(kwargs, field):
    with pytest.raises(LayoutError) as e:
        PL(**kwargs)
    assert str(e.value).startswith(field + ":")


@pytest.mark.parametrize(
    "layout,why",
    [
        (PL(16), "attn_tp_size 16 must divide model.num_heads 8"),  # a 16-way attention over 8 heads: needs DP groups
        (PL(32, 2, True), "attn_tp_size 16 must divide model.num_heads 8"),
        (PL(12, 12, True), "12 must divide model.vocab_size"),
        (PL(256, 256, True), "256 must divide model.vocab_size and model.intermediate_size"),  # 128 intermediate channels
    ],
    ids=lambda x: x.describe() if isinstance(x, PL) else None,
)
def test_layouts_the_model_cannot_be_sharded_over_name_the_rule(layout, why):
    with pytest.raises(LayoutError) as e:
        check_model_fits_layout(DEFAULT_MODEL, layout)
    assert str(e.value).startswith("layout.tp_size:") and why in str(e.value)


def test_deployed_worlds_need_enough_dp_groups():
    """The default model (8 heads) fits attn_tp_size <= 8: tp16 needs dp >= 2, tp32 dp >= 4, tp64 dp >= 8."""
    got = {(x.tp_size, x.dp_size) for x in deployed_layouts()}
    assert got == {(16, 2), (16, 4), (16, 8), (16, 16), (32, 4), (32, 8), (32, 16), (32, 32), (64, 8), (64, 16), (64, 32), (64, 64)}
    for tp in (16, 32, 64):
        branches = {x.branch for x in deployed_layouts() if x.tp_size == tp}
        assert branches == set(Branch), tp  # neither: dp == tp with the (ii) flags; attn-TP gather: dp < tp
    assert not set(deployed_layouts()) & set(all_layouts())


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


def test_groups_partition_a_four_node_world():
    layout = PL(32, 8, True, 1, True, "deepep")  # attn_tp 4: DP group d is ranks 4d..4d+3
    assert layout.group_ranks(Group.ATTN_TP, 13) == [12, 13, 14, 15]
    assert layout.group_ranks(Group.ATTN_DP, 13) == [1, 5, 9, 13, 17, 21, 25, 29]
    assert layout.capture_bs_base == 4
