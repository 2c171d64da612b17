"""I1 over every field (harness.props.p1_fields) on hand-built records: each rule, the exclusions, the notes, and the
introspection that finds a field nobody listed."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from harness.props.p1_fields import OTHERS, Excluded, FieldRule, Noted, check_capture_fields
from harness.run.records import CaptureRecord, FieldValue, ReplayRecord, batch_fields, field_value
from harness.verdict import Verdict

W = {"runner": "test", "bs": 4}


def record(capture: dict[str, FieldValue], replay: dict[str, FieldValue]) -> ReplayRecord:
    cap = CaptureRecord(4, 12, {}, None, None, capture)
    return ReplayRecord("test", 0, "neither", 3, 4, 3, cap, None, None, None, [], 0, 0, fields=replay)


def run(capture: dict, replay: dict, policy: Optional[dict] = None) -> Verdict:
    v = Verdict("P1")
    check_capture_fields(v, record(capture, replay), W, policy or {})
    return v


def host(x, default: bool = False) -> FieldValue:
    return FieldValue("host", value=x, default=default)


def test_a_field_left_at_its_default_is_reported_by_name():
    v = run({"seq_lens_sum": host(0, default=True), "batch_size": host(4)},
            {"seq_lens_sum": host(37), "batch_size": host(4)}, {"seq_lens_sum": FieldRule.BATCH})
    assert [(f.check, f.field) for f in v.failures] == [("I1", "seq_lens_sum")]
    assert "default" in v.failures[0].detail and v.checked == 1


def test_a_field_the_capture_never_set_is_reported():
    v = run({"batch_size": host(4)}, {"batch_size": host(4), "max_seq_len": host(9)})
    assert v.failures[0].field == "max_seq_len" and v.failures[0].got == "absent"


def test_a_bucket_determined_host_value_that_differs_is_reported():
    v = run({"dp_padding_mode": host("sum_len")}, {"dp_padding_mode": host("max_len")})
    assert v.failures[0].field == "dp_padding_mode"
    assert (v.failures[0].expected, v.failures[0].got) == ("'max_len'", "'sum_len'")


def test_a_batch_determined_value_set_at_capture_holds_whatever_its_value():
    assert run({"seq_lens_sum": host(4)}, {"seq_lens_sum": host(37)}, {"seq_lens_sum": FieldRule.BATCH}).ok


def test_tensors_compare_dtype_shape_and_storage():
    buf = torch.zeros(8, dtype=torch.int64)
    same = field_value(buf[:4])
    assert run({"positions": same}, {"positions": field_value(buf[:4])}).ok
    v = run({"positions": field_value(buf[:4].to(torch.int32))}, {"positions": same})
    assert v.failures[0].field == "positions" and "int32" in v.failures[0].got
    v = run({"positions": field_value(buf[:4].clone())}, {"positions": same})
    assert v.failures[0].got == "a tensor over other memory"


def test_prefix_takes_the_first_rows_of_the_whole_buffer_only():
    buf = torch.zeros(8, dtype=torch.int64)
    policy = {"seq_lens": FieldRule.PREFIX}
    assert run({"seq_lens": field_value(buf[:4])}, {"seq_lens": field_value(buf)}, policy).ok
    assert not run({"seq_lens": field_value(buf[:4].clone())}, {"seq_lens": field_value(buf)}, policy).ok
    assert not run({"seq_lens": field_value(buf[:4])}, {"seq_lens": field_value(buf[:2])}, policy).ok


def test_a_classified_exclusion_is_not_reported_and_a_noted_field_is_a_note():
    cap, rep = {"x": host(4)}, {"x": host(5)}
    assert run(cap, rep, {"x": Excluded("re-planned every replay", "a.py:1")}).ok
    v = run(cap, rep, {OTHERS: Noted("the live batch's own")})
    assert v.ok and len(v.notes) == 1 and "x" in v.notes[0] and "the live batch's own" in v.notes[0]


def test_the_first_field_is_reported_and_the_others_named():
    v = run({"a": host(1), "b": host(2)}, {"a": host(0), "b": host(0)})
    assert len(v.failures) == 1 and v.failures[0].field == "a" and "also differ: b" in v.failures[0].detail


def test_no_replay_fields_compares_nothing():
    v = run({"a": host(1)}, {})
    assert v.ok and v.checked == 0


@dataclass
class Spec:
    hidden: torch.Tensor
    width: int = 1


@dataclass
class Batch:
    batch_size: int
    seq_lens: torch.Tensor
    spec_info: Optional[Spec] = None
    seq_lens_sum: int = 0
    lens_cpu: list[int] = field(default_factory=list)


def test_batch_fields_introspects_every_field_with_its_default():
    b = Batch(4, torch.zeros(4, dtype=torch.int64), Spec(torch.zeros(4, 2)), lens_cpu=[3, 3])
    b.added_later = 7  # an attribute past the declared fields is a field too
    got = batch_fields(b)
    assert set(got) == {"batch_size", "seq_lens", "spec_info", "spec_info.hidden", "spec_info.width", "seq_lens_sum", "lens_cpu",
                        "added_later"}
    assert got["seq_lens_sum"] == FieldValue("host", value=0, default=True)
    assert got["lens_cpu"].value == (3, 3) and not got["lens_cpu"].default
    assert got["spec_info.width"].default and got["seq_lens"].shape == (4,) and got["seq_lens"].dtype == "int64"


# Each capture_fields mutant: the field I1 over every field names (worked out from the patch), and the counts-only I1
# (the check with the field comparison taken out) holding under it.
MUTANT_FIELDS = {
    "capture-seq-lens-sum-default": "seq_lens_sum",
    "single-layer-capture-extend-num-tokens-default": "extend_num_tokens",
    "verify-capture-padding-mode-sum-len": "dp_padding_mode",
    "decode-capture-seq-lens-cpu-copy": "seq_lens_cpu",
    "multi-layer-capture-positions-int32": "positions",
    "single-layer-capture-req-pool-indices-unsliced": "req_pool_indices",
}


def test_capture_field_mutants_are_killed_by_i1_over_every_field_alone(monkeypatch):
    import harness.props.p1_records as p1_records
    from harness.mutants import capture_fields
    from harness.props.p1 import probe_metadata_dp

    assert {m.id for m in capture_fields.MUTANTS} == set(MUTANT_FIELDS)
    for m in capture_fields.MUTANTS:
        with m.planted():
            v = probe_metadata_dp()["P1"]
            assert {(f.check, f.field) for f in v.failures} == {("I1", MUTANT_FIELDS[m.id])}, m.id
            with monkeypatch.context() as mp:
                mp.setattr(p1_records, "check_capture_fields", lambda *a, **k: None)
                assert probe_metadata_dp()["P1"].ok, f"{m.id}: the counts-only I1 kills it too"
