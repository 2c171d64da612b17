"""The rules past the model call on hand-built records: after_model.py's row rule and chain checks (both multi-layer
composites are held to them: the per-step one where its worker rotates, the one graph where it rotates inside the
graph) and the one graph's own check of the top-k its replay serves (harness/engines/sglang/one_graph.py). Every
expected value is written out by hand; the engine-driven side is tests/test_engine_check.py and test_engine_planted.py."""
from __future__ import annotations

from harness.engines.after_model import BodyRecord, check_body, next_token
from harness.engines.sglang.one_graph import check_served
from harness.verdict import Verdict


def test_body_checks_hold_the_hand_written_row_rule():
    """after_model's rules on hand-built records: request i's last accepted row at step s of a growing window
    is i*(T+s) + num_correct_drafts + s, its top-1 the stand-in's next token of what that row holds, and the
    next step's row holds it."""
    ncd, raw, T = [2, 0], 2, 4
    ids0 = list(range(100, 100 + raw * T))
    rows0 = [0 * T + 2, 1 * T + 0]  # by hand
    top0 = [next_token(ids0[r]) for r in rows0]
    step0 = BodyRecord("multi_layer", 0, raw, raw, T, T, False, [next_token(x) for x in ids0], top0, ids0)
    v = Verdict("P1")
    check_body(v, step0, ncd, None, {})
    assert v.ok and v.checked == 2, v.report()

    ids1 = [0] * (raw * (T + 1))
    rows1 = [0 * 5 + 2 + 1, 1 * 5 + 0 + 1]  # by hand: the window grew by the one token step 0 drafted
    for r, t in zip(rows1, top0, strict=True):
        ids1[r] = t
    top1 = [next_token(ids1[r]) for r in rows1]
    step1 = BodyRecord("multi_layer", 1, raw, raw, T + 1, T, False, [next_token(x) for x in ids1], top1, ids1)
    v = Verdict("P1")
    check_body(v, step1, ncd, step0, {})
    assert v.ok and v.checked == 3, v.report()

    # select_index without the step: top-1 taken from the row before
    wrong = BodyRecord("multi_layer", 1, raw, raw, T + 1, T, False, step1.returned_tokens, [next_token(ids1[r - 1]) for r in rows1], ids1)
    v = Verdict("P1")
    check_body(v, wrong, ncd, step0, {})
    assert [(f.check, f.field) for f in v.failures] == [("select", "topk_index")], v.report()
    # the chain wrote the drafted token one row late
    late = list(ids1)
    for r in rows1:
        late[r], late[r + 1] = 0, late[r]
    v = Verdict("P1")
    check_body(v, BodyRecord("multi_layer", 1, raw, raw, T + 1, T, False, [next_token(x) for x in late],
                             [next_token(late[r]) for r in rows1], late), ncd, step0, {})
    assert ("chain", "input_ids") in [(f.check, f.field) for f in v.failures], v.report()
    # a pruning runner hands back one row per request, from its last accepted row
    v = Verdict("P1")
    check_body(v, BodyRecord("single_layer", 0, raw, raw, T, T, True, [next_token(ids0[r + 1]) for r in rows0], None, ids0), ncd, None, {})
    assert [(f.check, f.field) for f in v.failures] == [("select", "returned logits")], v.report()


def test_rotated_chain_check_holds_the_hand_written_rotation():
    """Where the worker rotates (one window for all steps), step 1's rows up to each request's last accepted one are
    step 0's moved up a row, then the token step 0 drafted; rows after it are not checked. Written out by hand."""
    ncd, raw, T = [2, 0], 2, 4
    ids0 = [10, 11, 12, 13, 20, 21, 22, 23]
    top0 = [next_token(12), next_token(20)]  # rows 2 and 4: i*T + ncd
    step0 = BodyRecord("multi_layer", 0, raw, raw, T, T, False, [next_token(x) for x in ids0], top0, ids0)
    ids1 = [11, 12, top0[0], 99, top0[1], 98, 97, 96]  # request 0: 11, 12 moved up, then its draft; request 1: its draft at row 4
    rows1 = [2, 4]
    step1 = BodyRecord("multi_layer", 1, raw, raw, T, T, False, [next_token(x) for x in ids1], [next_token(ids1[r]) for r in rows1],
                       ids1, rotated=True)
    v = Verdict("P1")
    check_body(v, step1, ncd, step0, {})
    assert v.ok and v.checked == 4, v.report()  # returned logits, top-k, two windows

    # request 1's drafted token at its window's end (row i*T + T - 1), not at its last accepted row (request 0's is right)
    at_end = [11, 12, top0[0], 99, 21, 22, 23, top0[1]]
    v = Verdict("P1")
    check_body(v, BodyRecord("multi_layer", 1, raw, raw, T, T, False, [next_token(x) for x in at_end],
                             [next_token(at_end[r]) for r in rows1], at_end, rotated=True), ncd, step0, {})
    assert [(f.check, f.field, f.where["request"], f.where["row"]) for f in v.failures] == [("chain", "input_ids", 1, 4)], v.report()

    # not rotated (the adapter did not run the worker's rotation): nothing about the chain is claimed
    v = Verdict("P1")
    check_body(v, BodyRecord("multi_layer", 1, raw, raw, T, T, False, [next_token(x) for x in at_end],
                             [next_token(at_end[r]) for r in rows1], at_end), ncd, step0, {})
    assert v.ok and v.checked == 2, v.report()


def test_served_top_k_check_holds_each_step_to_its_own_rows():
    """What replay(step) served, read after the last step: one row per real request, each the top-1 of that step's
    last accepted row (i*T + num_correct_drafts: one window for all steps) of the input_ids it launched with."""
    ncd, raw, T = [2, 0], 2, 4
    ids2 = [11, 12, 13, 99, 21, 98, 97, 96]  # step 2's window: rows 2 and 4 are the last accepted ones
    body = BodyRecord("multi_layer_1g", 2, raw, 4, T, T, True, [], [next_token(13), next_token(21)], ids2, rotated=True)
    v = Verdict("P1")
    check_served(v, 2, [next_token(13), next_token(21)], body, ncd, {})
    assert v.ok and v.checked == 2, v.report()
    # another step's top-k (here: the rows of step 2 shifted by one), and the bucket's rows (4) where 2 are real
    v = Verdict("P1")
    check_served(v, 2, [next_token(12), next_token(21)], body, ncd, {})
    assert [(f.check, f.field, f.where["request"]) for f in v.failures] == [("served", "topk_index", 0)], v.report()
    v = Verdict("P1")
    check_served(v, 2, [next_token(13), next_token(21), 0, 0], None, ncd, {})
    assert [(f.check, f.field, f.expected, f.got) for f in v.failures] == [("padding", "served top-k rows", 2, 4)], v.report()
