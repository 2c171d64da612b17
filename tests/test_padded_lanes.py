"""P2: padded lanes hold the canonical fill after replay, and poisoning them (and every stale
region) leaves real rows and live KV bit-identical; which mutants P2 kills, one of them alone."""
import pytest

from harness import mutants
from harness.cases.case import load_case
from harness.props.p2 import LanePoison, check_padded_lanes
from harness.props.p5 import check_spec_case
from harness.run.loop import SpecSession, Workload, run_workload
from harness.verdict import Verdict
from runners.config import SpecConfig
from runners.parallel.layout import ParallelLayout as PL

SHRINK = Workload(((6,), (3,), (1,)), rounds_per_phase=2)  # buckets 8 -> 4 -> 1: stale lanes from a larger batch


@pytest.mark.parametrize("name", ["tp2_shrink", "tp4_dp2_mlp_tp_gather", "tp4_neither_topk2", "tp2_shrink_one_graph"])
def test_p2_holds_on_shipped_cases(name):
    v = check_padded_lanes(load_case(name))
    assert set(v) == {"P2"} and v["P2"], v["P2"].report()
    assert v["P2"].checked > 200


def test_p2_checks_every_replay_and_leaves_the_run_unchanged():
    spec = SpecConfig(num_steps=3, capture_bs=(1, 2, 4, 8), max_running_requests=8)
    plain = run_workload(SpecSession(PL(), spec, runner="graph"), SHRINK)
    v = Verdict("P2")
    poisons = []
    poisoned = run_workload(SpecSession(PL(), spec, runner="graph", hook=lambda e: poisons.append(LanePoison(e, v))), SHRINK)
    assert v, v.report()
    (p,) = poisons
    assert 2 * p.replays == sum(len(recs[0].extend) for recs in poisoned.records) > 0  # every replay of every draft step, twice: clean, poisoned
    a, b = plain.requests(), poisoned.requests()
    assert {k: (r.tokens, r.accept_lens) for k, r in a.items()} == {k: (r.tokens, r.accept_lens) for k, r in b.items()}


@pytest.mark.parametrize(
    "mutant,check,field",
    [
        ("stale-padded-tokens-after-shrink", "canonical", "input_ids"),  # co-killed by P8
        ("seq-len-advanced-for-padded-rows", "canonical", "seq_lens"),
        ("stale-padded-seq-lens", "canonical", "seq_lens"),
        ("padded-kv-write-live-slot", "canonical", "out_cache_loc"),
        ("attn-reads-masked-kv", "poison", "logits"),
        ("padded-accept-len-zero", "canonical", "num_correct_drafts"),  # co-killed by P3, P4, P8
        ("stale-padded-req-pool-indices", "canonical", "out_cache_loc"),  # the in-graph lookup's slot; co-killed by P3, P4, P8
        ("stale-padded-positions", "canonical", "positions"),  # harmless behind the padding row: only the fill check sees it
    ],
)
def test_p2_kills(mutant, check, field):
    with mutants.get(mutant).planted():
        v = check_padded_lanes(load_case("tp2_shrink"))["P2"]
    assert not v
    f = v.failures[0]
    assert (f.check, f.field) == (check, field), f.message()
    assert "lane" in f.where or "row" in f.where, f.message()


def test_p2_poison_names_the_real_row_that_read_a_poisoned_value():
    with mutants.get("padded-kv-write-live-slot").planted():
        v = check_padded_lanes(load_case("tp2_shrink"))["P2"]
    poison = [f for f in v.failures if f.check == "poison"]
    assert poison, v.report()
    assert "read a poisoned value" in poison[0].detail or "changed" in poison[0].detail
    # the padded lanes write (through the last live request row) into that request's position-0 slot, at
    # position 0 in the clean replay and at the poisoned position in the other: the real row they share changes
    f = poison[0]
    assert f.got.startswith("NaN") or f.field.startswith("draft KV") or f.got == "differs", f.message()
    assert f.where["row"] < f.where["raw_bs"] * 4, f.message()  # a real row (T = 4), named


def test_p2_alone_kills_a_masked_kv_read():
    """NaN never occurs in a clean run, so only the poisoned replay can see attention read masked slots."""
    with mutants.get("attn-reads-masked-kv").planted():
        others = check_spec_case(load_case("tp1_neither"), runners=("graph",))
        p2 = check_padded_lanes(load_case("tp2_shrink"))["P2"]
    assert others["P5"] and others["P6"], (others["P5"].report(), others["P6"].report())
    assert not p2 and p2.failures[0].got == "NaN (a poisoned value)"


def test_out_of_domain_num_correct_drafts_would_leak_into_a_real_row():
    """Why P2 keeps num_correct_drafts in [0, T-1] on padded lanes: the step body writes each lane's
    proposal at row i*T + num_correct_drafts[i], so a padded lane holding -1 (a sentinel such as
    num_accept_tokens - 1 = -2 would do the same) overwrites a row of the last real lane's next_input_ids."""
    spec = SpecConfig(num_steps=3, capture_bs=(4,), max_running_requests=4)
    s = SpecSession(PL(), spec, runner="graph")
    runner = s.engines[0].draft.driver.runners[0]
    real_replay = runner.replay
    changed_rows = []

    def replay(inp):
        out_clean = real_replay(inp).cloned()  # the next replay overwrites the views a replay returns (runners.outputs)
        saved = runner.num_correct_drafts.clone()  # a step replays the buffers as prepared: sabotage them, replay, restore
        runner.num_correct_drafts[inp.bs:] = -1
        out_bad = real_replay(inp)
        runner.num_correct_drafts.copy_(saved)
        rows = (out_clean.next_input_ids != out_bad.next_input_ids).nonzero().flatten().tolist()
        changed_rows.extend((row, inp.bs * runner.T - 1) for row in rows)  # the first padded lane selects raw_bs*T - 1
        return out_clean

    runner.replay = replay
    s.step([("add", rid, tuple(range(5 + rid, 13 + rid)), 16, 0) for rid in range(3)])
    for _ in range(6):
        s.step()
    assert changed_rows, "the spilled proposal never differed from the row it overwrote"
    assert all(row == want for row, want in changed_rows), changed_rows  # only the last real lane's last row
