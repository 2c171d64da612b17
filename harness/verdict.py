"""Structured verdicts: what a property found, readable at a glance and as JSON."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass
class Failure:
    """One failed check, structured so that a person and a program read the same thing: the property and the check
    inside it (`I3`, `padding`, `logits`), the field, `where` (layout, branch, runner, rank, iteration, step,
    bucket) and expected vs got. `message()` is the line the CLI prints; `harness explain` says what its property
    or invariant asserts.
    """
    prop: str  # P1, P3, P4, ...
    check: str  # I1, I2, ..., padding, logits, ...
    field: str  # the metadata field or output tensor
    where: dict[str, Any]  # layout, branch, runner, rank, iteration, step, raw_bs, bs
    expected: Any
    got: Any
    detail: str = ""

    def message(self) -> str:
        loc = ", ".join(f"{k}={v}" for k, v in self.where.items())
        msg = f"{self.prop}/{self.check} {self.field}: expected {self.expected}, got {self.got} [{loc}]"
        return msg + (f" — {self.detail}" if self.detail else "")


@dataclass
class Verdict:
    """What one property found: the failures, the notes (legal engine variants, reported with their evidence but not
    failed), and `checked`, the number of comparisons made, so a verdict that held because nothing was compared
    can be told apart from one that held on evidence.
    """
    prop: str
    checked: int = 0
    failures: list[Failure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def __bool__(self) -> bool:  # `assert verdict` reads naturally in tests
        return self.ok

    def fail(self, check: str, field_: str, where: dict, expected: Any, got: Any, detail: str = "") -> None:
        self.failures.append(Failure(self.prop, check, field_, dict(where), expected, got, detail))

    def expect_equal(self, check: str, field_: str, where: dict, expected: Any, got: Any, detail: str = "") -> bool:
        self.checked += 1
        if expected != got:
            self.fail(check, field_, where, expected, got, detail)
            return False
        return True

    def expect_agree(self, check: str, field_: Optional[str], where: dict, sides: dict[str, Any], rule: Any, rule_text: str) -> bool:
        """A symmetric invariant: the named sides must agree. The failure names every side and blames the ones that break
        `rule` (what each side must equal, `rule_text` says why), so the healthy side is never the one reported wrong:
        expected is the rule, got the wrong side's value. field_ None: the wrong side's name is the field."""
        self.checked += 1
        values = list(sides.values())
        if all(x == values[0] for x in values[1:]):
            return True
        wrong = {name: x for name, x in sides.items() if x != rule} or dict(sides)
        names = " and ".join(wrong)
        got = next(iter(wrong.values())) if len(wrong) == 1 else wrong
        both = ", ".join(f"{name} {x}" for name, x in sides.items())
        self.fail(check, field_ or names, where, rule, got,
                  f"{both}: each must be {rule_text}; the {names} {'breaks' if len(wrong) == 1 else 'break'} it (see `harness explain {check}`)")
        return False

    def merge(self, other: "Verdict") -> "Verdict":
        self.checked += other.checked
        self.failures.extend(other.failures)
        self.notes.extend(other.notes)
        return self

    def first(self) -> str:
        return self.failures[0].message() if self.failures else "ok"

    def report(self, limit: int = 5) -> str:
        if self.ok:
            return f"{self.prop}: ok ({self.checked} checks)"
        lines = [f"{self.prop}: {len(self.failures)} failure(s) in {self.checked} checks"]
        lines += ["  " + f.message() for f in self.failures[:limit]]
        if len(self.failures) > limit:
            lines.append(f"  ... and {len(self.failures) - limit} more")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"property": self.prop, "ok": self.ok, "checked": self.checked, "failures": [asdict(f) for f in self.failures], "notes": self.notes}


def merge_verdicts(into: dict[str, Verdict], got: dict[str, Verdict]) -> dict[str, Verdict]:
    """Fold per-property verdicts into `into` (one Verdict per property name); returns `into`."""
    for prop, v in got.items():
        into.setdefault(prop, Verdict(prop)).merge(v)
    return into
