"""Known findings: a baseline file that lets a team gate every merge on new engine-check findings only.

`--write-baseline FILE` writes what a run found; `--baseline FILE` classifies every finding of a
later run as known (in the file) or new. A finding is named by what stays put across runs and
releases -- the property, check and field, and the line it sits on (runner, step, branch or DP
size, device path) plus the page size where the check has one -- never by bucket, rank,
iteration or lane, which move with every schedule change. An entry the run checked (some line of
the run has its runner, step, branch and path) but did not find is stale: reported, not an
error (the finding went away: drop it from the file). An entry for what the run did not check
(another --path or --runner) is neither.

The file is JSON, sorted, one finding per entry, readable and diffable:

    {"format": "specharness-engine-check-baseline/1", "engine": "sglang", "written_from": "sglang 0.5.23",
     "findings": [{"prop": "P1", "check": "stale slot", "field": "out_cache_loc", "runner": "multi_layer",
                   "step": 0, "branch": "neither", "path": "npu"}, ...]}

An entry may carry a "reason" (free text, kept when the file is read) for the people reading it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Union

FORMAT = "specharness-engine-check-baseline/1"
# where a finding sits (the line's identity and the keys a report adds): what an entry may name besides its check
IDENTITY_KEYS = ("runner", "step", "branch", "dp", "path", "page_size")
CHECK_KEYS = ("prop", "check", "field")
Value = Union[str, int]


class BaselineError(ValueError):
    """A baseline file engine-check cannot use: the message names the file and the field."""


@dataclass(frozen=True, order=True)
class Finding:
    """One finding's identity: its check and the stable parts of where it sits."""

    prop: str
    check: str
    field: str
    where: tuple[tuple[str, Value], ...]

    @classmethod
    def of(cls, line_identity: dict[str, Value], failure: Any, extra_keys: Iterable[str]) -> "Finding":
        where = {**line_identity, **{k: failure.where[k] for k in extra_keys if k in failure.where}}
        return cls(failure.prop, failure.check, failure.field, _ordered(where))

    def to_json(self) -> dict[str, Value]:
        return {"prop": self.prop, "check": self.check, "field": self.field, **dict(self.where)}

    def covered_by(self, line_identity: dict[str, Value]) -> bool:
        """A line of the run sits where this finding would: the run checked it."""
        mine = dict(self.where)
        return all(mine.get(k) == v for k, v in line_identity.items())

    def describe(self) -> str:
        return f"{self.prop}/{self.check} {self.field} [{', '.join(f'{k}={v}' for k, v in self.where)}]"


@dataclass
class Baseline:
    engine: str
    findings: dict[Finding, str]  # -> its reason ("" where none)
    written_from: str = ""

    @classmethod
    def load(cls, path: Path) -> "Baseline":
        try:
            doc = json.loads(Path(path).read_text())
        except OSError as e:
            raise BaselineError(f"{path}: cannot read it: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise BaselineError(f"{path}: not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise BaselineError(f"{path}: the top level must be an object with format, engine and findings")
        unknown = sorted(set(doc) - {"format", "engine", "written_from", "findings"})
        if unknown:
            raise BaselineError(f"{path}: {unknown[0]}: not a field of a baseline (format, engine, written_from, findings)")
        if doc.get("format") != FORMAT:
            raise BaselineError(f"{path}: format: expected {FORMAT!r}, got {doc.get('format')!r}")
        engine = doc.get("engine")
        if not isinstance(engine, str) or not engine:
            raise BaselineError(f"{path}: engine: expected the engine's name (e.g. \"sglang\"), got {engine!r}")
        entries = doc.get("findings")
        if not isinstance(entries, list):
            raise BaselineError(f"{path}: findings: expected a list of findings, got {type(entries).__name__}")
        findings: dict[Finding, str] = {}
        for i, entry in enumerate(entries):
            f, reason = _entry(path, i, entry)
            if f in findings:
                raise BaselineError(f"{path}: findings[{i}]: the same finding as an earlier entry ({f.describe()})")
            findings[f] = reason
        return cls(engine, findings, str(doc.get("written_from", "")))

    def write(self, path: Path) -> None:
        """Sorted, one finding a line: a diff of two baselines is the findings that came and went."""
        head = {"format": FORMAT, "engine": self.engine, "written_from": self.written_from}
        entries = [json.dumps({**f.to_json(), **({"reason": r} if r else {})}) for f, r in sorted(self.findings.items())]
        body = "".join(f'  "{k}": {json.dumps(v)},\n' for k, v in head.items())
        Path(path).write_text("{\n" + body + '  "findings": [\n' + ",\n".join(f"    {e}" for e in entries)
                              + ("\n" if entries else "") + "  ]\n}\n")

    def classify(self, found: list[Finding], lines: list[dict[str, Value]], file: str) -> "Classified":
        known = set(self.findings)
        missing = sorted(known - set(found))
        return Classified(file, {f: f in known for f in found},
                          stale=[f for f in missing if any(f.covered_by(ln) for ln in lines)],
                          not_checked=[f for f in missing if not any(f.covered_by(ln) for ln in lines)])


@dataclass
class Classified:
    """A run's findings against a baseline: each known or new; the entries not found, stale or not checked."""

    file: str
    known: dict[Finding, bool]
    stale: list[Finding] = field(default_factory=list)
    not_checked: list[Finding] = field(default_factory=list)

    @property
    def new(self) -> list[Finding]:
        return sorted(f for f, k in self.known.items() if not k)

    def to_json(self) -> dict:
        return {"file": self.file, "ok": not self.new, "new": len(self.new), "known": sum(self.known.values()),
                "new_findings": [f.to_json() for f in self.new], "stale": [f.to_json() for f in self.stale],
                "not_checked": [f.to_json() for f in self.not_checked]}

    def text(self) -> list[str]:
        out = [f"baseline {self.file}: {len(self.new)} new, {sum(self.known.values())} known finding identities"]
        out += [f"  new: {f.describe()}" for f in self.new]
        out += [f"  stale (in the baseline, checked, no longer found: drop it): {f.describe()}" for f in self.stale]
        if self.not_checked:
            out.append(f"  {len(self.not_checked)} baseline entries not checked by this run (another --path or --runner)")
        return out


def _entry(path: Path, i: int, entry: Any) -> tuple[Finding, str]:
    at = f"{path}: findings[{i}]"
    if not isinstance(entry, dict):
        raise BaselineError(f"{at}: expected an object, got {type(entry).__name__}")
    for k in CHECK_KEYS:
        if not isinstance(entry.get(k), str) or not entry[k]:
            raise BaselineError(f"{at}.{k}: expected a non-empty string, got {entry.get(k)!r}")
    where: dict[str, Value] = {}
    for k, v in entry.items():
        if k in CHECK_KEYS or k == "reason":
            continue
        if k not in IDENTITY_KEYS:
            raise BaselineError(f"{at}.{k}: not part of a finding's identity (one of {', '.join(CHECK_KEYS + IDENTITY_KEYS)}, or reason)")
        if not isinstance(v, (str, int)) or isinstance(v, bool):
            raise BaselineError(f"{at}.{k}: expected a string or an integer, got {v!r}")
        where[k] = v
    reason = entry.get("reason", "")
    if not isinstance(reason, str):
        raise BaselineError(f"{at}.reason: expected a string, got {reason!r}")
    return Finding(entry["prop"], entry["check"], entry["field"], _ordered(where)), reason


def _ordered(where: dict[str, Value]) -> tuple[tuple[str, Value], ...]:
    return tuple(sorted(where.items(), key=lambda kv: IDENTITY_KEYS.index(kv[0])))
