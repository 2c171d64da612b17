"""Probes over the drafts of a kind or placement of their own, for `harness mutants`: the EAGLE3 draft
(runners.llama_eagle3) and the draft at a TP size of its own (runners.draft_parallel), over their shipped cases and
SGLang's EAGLE3 placement under DP attention (`single_group_case`).

The tree probes run the case's workload eagerly against its draft-tree golden (P6); the loop probes run it eager and graph (harness.decode_props.check_decode_case): P1 on every
draft-decode replay, P3 eager vs graph trees, P6 the acceptance golden and the draft-tree golden, whose probabilities
see what only the draft's numbers show (a layer captured off by one, a rotary base, a draft-to-target id). The case
probes are `harness check`'s default run (P1, P3, P4 of the draft-extend runners against the TP1 run of the same
weights). CHURN_EAGLE3_SPEC is P8's EAGLE3 draft (tests/test_eagle3.py).
"""
from __future__ import annotations

from pathlib import Path

from harness.case import Case, load_case
from harness.case_template import case_toml, validate_text
from harness.checks import check_case
from harness.decode_props import check_decode_case
from harness.golden.draft_tree import check_tree_golden
from harness.props.spec_probes import _guarded
from harness.spec_decode import case_session
from harness.verdict import Verdict
from runners.config import ModelConfig, SpecConfig
from runners.parallel.layout import ParallelLayout

EAGLE3_CASE = "tp2_dp2_eagle3"  # TP2 DP2, EAGLE3 with three captured layers, a 256-token vocab, topk 2 trees
DRAFT_TP_CASE = "tp4_dp2_eagle3_draft_tp1"  # TP4 DP2, the EAGLE3 draft at TP1 with its own rotary table, proposals handed on

# P8 over the EAGLE3 draft at TP1: the default model's two layers, both captured (the embeddings and layer 0's output)
CHURN_EAGLE3_SPEC = SpecConfig(num_steps=3, topk=2, capture_bs=(1, 2, 4, 8), max_running_requests=8, draft="eagle3",
                               eagle_aux_hidden_state_layer_ids=(-1, 0), draft_vocab_size=256)


def single_group_case() -> Case:
    """SGLang's EAGLE3 draft under DP attention (DraftTPExecution.SINGLE_GROUP): plain TP over each attention-TP group,
    draft_tp_size = attn_tp_size = 2 under TP4 DP2, no collective across DP groups. Not shipped (no goldens): P1, P3 and
    P4 against the TP1 run of the same weights see a draft collective over the wrong ranks."""
    spec = SpecConfig(num_steps=3, topk=1, capture_bs=(1, 2, 4), max_running_requests=4, draft="eagle3",
                      eagle_aux_hidden_state_layer_ids=(0, 1, 2), draft_vocab_size=256, draft_tp_size=2)
    text = case_toml("tp4_dp2_eagle3_single_group", "TP4 DP2, the EAGLE3 draft at TP2 inside each attention-TP group",
                     ParallelLayout(tp_size=4, dp_size=2, enable_dp_attention=True), spec, [[3, 1], [1, 2]],
                     model=ModelConfig(num_target_layers=4, num_kv_heads=8), max_prefix_len=16)
    return validate_text(text, Path("<tp4_dp2_eagle3_single_group>"))


def eager_tree(name: str) -> dict[str, Verdict]:
    """P6 on the eager run alone: its draft trees against the case's draft-tree golden. The cheap probe for a mutant of
    the step body, which eager and graph share."""
    case, v = load_case(name), Verdict("P6")
    check_tree_golden(v, case, {"eager": case_session(case, "eager")})
    return {"P6": v}


probe_eagle3_tree = _guarded("eagle3-tree", lambda: eager_tree(EAGLE3_CASE))
probe_draft_tp_tree = _guarded("draft-tp-tree", lambda: eager_tree(DRAFT_TP_CASE))
probe_eagle3_loop = _guarded("eagle3-loop", lambda: check_decode_case(load_case(EAGLE3_CASE)))
probe_eagle3_case = _guarded("eagle3-case", lambda: check_case(load_case(EAGLE3_CASE)).verdicts)
probe_draft_tp_loop = _guarded("draft-tp-loop", lambda: check_decode_case(load_case(DRAFT_TP_CASE)))
probe_draft_tp_case = _guarded("draft-tp-case", lambda: check_case(load_case(DRAFT_TP_CASE)).verdicts)
probe_draft_tp_group = _guarded("draft-tp-group", lambda: check_case(single_group_case()).verdicts)

DRAFT_PROBES = (("eagle3-tree", probe_eagle3_tree), ("eagle3-case", probe_eagle3_case), ("eagle3-loop", probe_eagle3_loop),
                ("draft-tp-tree", probe_draft_tp_tree),
                ("draft-tp-case", probe_draft_tp_case), ("draft-tp-loop", probe_draft_tp_loop), ("draft-tp-group", probe_draft_tp_group))
