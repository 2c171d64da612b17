"""I1 over every field: what a replay writes for a bucket, each field against the capture's value for that bucket.

A graph bakes every host value of the forward batch its capture built; the replay writes the static buffers and
hands its own view of the batch (the attention backend's replay plan, the spec info) to the code outside the graph.
A field the replay sets that the capture left at its default, or built with another dtype or shape, or as a tensor
of its own instead of the static buffer the replay writes, is baked wrong, whether or not the counts agree.

The fields are introspected (harness.run.records.batch_fields), never listed: every field the replay writes is
compared, by the rule of its kind unless a policy classifies it:

- a host value (int, list, enum) is bucket-determined (`FieldRule.BUCKET`): the capture's value must be the
  replay's;
- a tensor is batch-determined (`FieldRule.BATCH`): its values are the live batch's, so the capture must have SET
  it, with the replay's dtype and shape, and (where both name one) over the same storage: the graph reads the buffer
  the replay writes, not a copy;
- a policy may make a host value batch-determined (seq_lens_sum: the live lanes' sum), a tensor bucket-determined
  (the gathered counts: compared by value too) or the first rows of a buffer the replay hands over whole
  (`FieldRule.PREFIX`), exclude a field that is never baked, with the reason and the source line that shows it
  (`Excluded`), or report a difference not yet settled against the source as a note (`Noted`).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Mapping, Optional, Union

from harness.run.records import FieldValue, ReplayRecord
from harness.verdict import Verdict


class FieldRule(Enum):
    BUCKET = "bucket"  # determined by the bucket: dtype, shape and value as at capture
    BATCH = "batch"  # determined by the live batch: set at capture, with the replay's dtype and shape
    # a static buffer the replay hands over whole (the reader takes the bucket's first lanes): the capture's field is
    # the bucket's first rows of that buffer: its dtype, its trailing shape, at most its rows, the same storage
    PREFIX = "prefix"


@dataclass(frozen=True)
class Excluded:
    """A field the replay writes that the capture may legitimately hold otherwise: never baked (read again outside the
    graph, or by no captured kernel). `source` is where that is seen (file:line of the release, or of our runners)."""

    reason: str
    source: str


@dataclass(frozen=True)
class Noted:
    """A difference read but not yet settled against the release's source: reported as a note with the field and the
    values (never hidden, never a failure) until the source says bug (drop it: the rule fails it) or not (Excluded)."""

    reason: str


Disposition = Union[FieldRule, Excluded, Noted]
FieldPolicy = Mapping[str, Disposition]
OTHERS = "*"  # a policy's entry for the fields it does not name (unset: the rule of each one's kind)


def rule_for(name: str, value: FieldValue, policy: FieldPolicy) -> Disposition:
    """The field's own entry, else its parent's 'NAME.*' (the spec info's fields), else the policy's OTHERS, else its kind's rule."""
    parent = name.rsplit(".", 1)[0] + ".*" if "." in name else None
    ruled = policy.get(name, policy.get(parent) if parent else None)
    ruled = policy.get(OTHERS) if ruled is None else ruled
    if ruled is not None:
        return ruled
    return FieldRule.BATCH if value.kind == "tensor" else FieldRule.BUCKET


def field_problem(rule: FieldRule, cap: Optional[FieldValue], rep: FieldValue) -> Optional[tuple[str, str, str]]:
    """(expected, got, why) when the capture's value breaks the rule against the replay's; None when it holds."""
    if cap is None or not cap.is_set:
        return rep.describe(), "absent" if cap is None else cap.describe(), "the replay sets it; the capture never did"
    if rule is FieldRule.BATCH and cap.default and cap.kind != "tensor":
        return f"a value set for the bucket (the replay's: {rep.describe()})", cap.describe(), "the capture left it at its default"
    if cap.kind != rep.kind:
        return rep.describe(), cap.describe(), "another kind of value"
    if cap.kind == "tensor" and rule is FieldRule.PREFIX:
        first_rows = cap.shape[1:] == rep.shape[1:] and len(cap.shape) == len(rep.shape) and cap.shape[:1] <= rep.shape[:1]
        if cap.dtype != rep.dtype or not first_rows:
            return f"the first rows of {rep.describe()}", cap.describe(), "another dtype or shape than the buffer the replay hands over"
        if cap.storage is not None and rep.storage is not None and cap.storage != rep.storage:
            return "the first rows of the buffer the replay hands over", "a tensor over other memory", \
                "the graph reads what the capture built, never what the replay writes"
        return None
    if cap.kind == "tensor":
        if (cap.dtype, cap.shape) != (rep.dtype, rep.shape):
            return rep.describe(), cap.describe(), "another dtype or shape than the replay writes"
        if cap.storage is not None and rep.storage is not None and cap.storage != rep.storage:
            return "a view of the buffer the replay writes", "a tensor over other memory", \
                "the graph reads what the capture built, never what the replay writes"
        if rule is FieldRule.BUCKET and cap.sample is not None and rep.sample is not None and cap.sample != rep.sample:
            return rep.describe(), cap.describe(), "a bucket-determined value"
        return None
    if cap.kind == "object":
        return None if cap.value == rep.value else (rep.describe(), cap.describe(), "another type")
    if rule is FieldRule.BUCKET and cap.value != rep.value:
        why = "the capture left it at its default" if cap.default else "a bucket-determined value"
        return rep.describe(), cap.describe(), why
    return None


def check_capture_fields(v: Verdict, rec: ReplayRecord, where: dict, policy: FieldPolicy, check: str = "I1") -> None:
    """Every field the replay wrote (rec.fields) against the capture's (rec.capture.fields); the first that differs is
    reported, with its name, the rule it breaks and the others that differ too. One check per record; nothing is
    compared where the replay's fields were not observed."""
    if not rec.fields:
        return
    v.checked += 1
    bad: list[tuple[str, tuple[str, str, str]]] = []
    for name in sorted(rec.fields):
        rep = rec.fields[name]
        if not rep.is_set:
            continue  # the replay leaves it unset: nothing the capture must match
        rule = rule_for(name, rep, policy)
        if isinstance(rule, Excluded):
            continue
        default = FieldRule.BATCH if rep.kind == "tensor" else FieldRule.BUCKET
        problem = field_problem(default if isinstance(rule, Noted) else rule, rec.capture.fields.get(name), rep)
        if problem is None:
            continue
        if isinstance(rule, Noted):
            expected, got, why = problem
            loc = ", ".join(f"{k}={x}" for k, x in where.items())
            v.notes.append(f"{v.prop}/{check} {name}: the replay's {expected} vs the capture's {got} ({why}): {rule.reason}; "
                           f"not settled against the source, reported [{loc}]")
            continue
        bad.append((name, problem))
    if not bad:
        return
    name, (expected, got, why) = bad[0]
    rule = rule_for(name, rec.fields[name], policy)
    also = f"; also differ: {', '.join(n for n, _ in bad[1:])}" if len(bad) > 1 else ""
    v.fail(check, name, where, expected, got, f"{why} ({rule.value}-determined field, baked at capture vs written by the replay){also}")
