"""P2 over the single-layer draft decode's graph runner inside the loop at TP2 (harness.props.poison):
the replay fill's padded lanes are canonical, poisoning them changes no real tree and no live KV, and
the draft-decode fill mutants are each seen, by the canonical check or by the poison alone."""
from unittest import mock

import pytest

from harness import mutants
from harness.cases.case import load_case
from harness.props import poison
from harness.props.p2 import check_padded_lanes
from harness.run.loop import case_session

CASE = "tp2_single_layer_shrink"  # TP2, attn-TP gather, a batch that shrinks across buckets


def _trees(session):
    return {k: (r.tokens, r.accept_lens) for k, r in session.requests().items()}


def test_every_draft_decode_replay_is_poisoned_and_the_run_is_unchanged():
    case = load_case(CASE)
    assert case.layout.tp_size == 2 and case.scenario.spec.draft == "single_layer"
    poisons: list[poison.DecodePoison] = []
    poisoned = case_session(case, "graph", hook=poison.install_decode_poison(poisons), rounds_per_phase=2)
    clean = case_session(case, "graph", rounds_per_phase=2)
    assert len(poisons) == 2, "one per rank"
    for p in poisons:
        assert p.v, p.v.report()
        # every replay of the loop's draft decodes, as the unpoisoned run's observer saw them (the prefill's too, which it does not record)
        assert p.replays >= sum(len(recs[p.engine.ctx.tp_rank].decode) for recs in clean.records) > 0
    assert _trees(poisoned) == _trees(clean)


@pytest.mark.parametrize("mutant,field", [("decode-fill-seq-lens", "seq_lens"), ("decode-fill-req-pool-indices", "req_pool_indices"),
                                          ("decode-fill-positions", "positions"), ("decode-fill-topk-index", "topk_index")])
def test_canonical_fill_kills_the_decode_fill_mutants_at_tp2(mutant, field):
    with mutants.get(mutant).planted():
        v = check_padded_lanes(load_case(CASE))["P2"]
    f = v.failures[0]
    assert (f.check, f.field, f.where["runner"]) == ("canonical", field, "draft_decode"), v.report()


def test_poison_alone_sees_a_stale_request_row():
    """Without the canonical check: the stale row sends the padded lanes' in-graph KV writes, and with the poisoned
    seq_len their reads, into a live request's slots, and a real tree changes."""
    with mock.patch.object(poison.DecodePoison, "_check_canonical", lambda *a: None), \
            mutants.get("decode-fill-req-pool-indices").planted():
        v = check_padded_lanes(load_case(CASE))["P2"]
    assert not v and v.failures[0].check == "poison" and v.failures[0].where["runner"] == "draft_decode", v.report()
