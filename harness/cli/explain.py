"""`harness explain ID`: what a property (P1-P8) or one of P1's invariants (I1-I7) asserts, why the engine needs it,
and a bug it catches.

The text is harness/props/reference.md, shipped inside the package: the docs site includes the same file, so a
failure's `see harness explain I3` and the docs page can never say two different things.
"""
from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from importlib import resources

from harness.errors import UsageError

# `## P1 — metadata invariants {#p1}`: the anchor is the id (stable across title edits, and the docs page's anchor)
_HEADING = re.compile(r"^(#{2,3}) (.+?) \{#([a-z0-9-]+)\}\s*$")


@dataclass(frozen=True)
class Section:
    id: str  # as a user types it and a failure prints it: "P1", "I3"; other anchors as they are ("padding")
    title: str
    body: str
    children: tuple[str, ...] = ()  # the ids of the sections nested under it (P1's invariants)

    def text(self) -> str:
        lines = [self.title, "", self.body.replace("**", "")]
        if self.children:
            lines += ["", f"Checks inside it: {', '.join(self.children)} (harness explain {self.children[0]})."]
        return "\n".join(lines).rstrip() + "\n"


def reference_text() -> str:
    return resources.files("harness.props").joinpath("reference.md").read_text(encoding="utf-8")


def _user_id(anchor: str) -> str:
    return anchor.upper() if re.fullmatch(r"[pi]\d+", anchor) else anchor


def sections(text: str | None = None) -> dict[str, Section]:
    """Every `## ... {#id}` and `### ... {#id}` section of the reference, by id, in file order. A section's body runs to
    the next heading of any level, so P1's own text stops where its first invariant begins."""
    text = reference_text() if text is None else text
    found: list[tuple[int, str, str, list[str]]] = []  # (level, id, title, body lines)
    for line in text.splitlines():
        m = _HEADING.match(line)
        if m:
            found.append((len(m.group(1)), _user_id(m.group(3)), m.group(2), []))
        elif line.startswith("#"):
            found.append((len(line) - len(line.lstrip("#")), "", "", []))  # a heading without an id ends the section before it
        elif found:
            found[-1][3].append(line)
    out: dict[str, Section] = {}
    for i, (level, sid, title, body) in enumerate(found):
        if not sid:
            continue
        children = []
        for lvl, cid, _, _ in found[i + 1 :]:
            if lvl <= level:
                break
            if cid:
                children.append(cid)
        if sid in out:
            raise ValueError(f"harness/props/reference.md: the id {sid} is used twice")
        out[sid] = Section(sid, title, "\n".join(body).strip(), tuple(children))
    return out


def lookup(wanted: str) -> Section:
    """The section for `wanted` (any case: p2, P2); an unknown id is a usage error naming the closest ones."""
    known = sections()
    by_key = {k.lower(): s for k, s in known.items()}
    if wanted.lower() in by_key:
        return by_key[wanted.lower()]
    close = difflib.get_close_matches(wanted.lower(), list(by_key), n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(by_key[c].id for c in close)}? " if close else ""
    raise UsageError(f"harness explain: unknown id {wanted!r}; {hint}known: {', '.join(known)}")


def cmd_explain(args) -> int:
    if args.id is None:
        listed = list(sections().values())
        if args.json:
            print(json.dumps([{"id": s.id, "title": s.title} for s in listed], indent=2))
        else:
            width = max(len(s.id) for s in listed)
            for s in listed:
                print(f"{s.id:<{width}}  {s.title.split(' — ', 1)[-1]}")
            print("\nharness explain ID prints one of them.")
        return 0
    s = lookup(args.id)
    if args.json:
        print(json.dumps({"id": s.id, "title": s.title, "text": s.text()}, indent=2))
    else:
        print(s.text(), end="")
    return 0


def add_parser(subparsers) -> None:
    s = subparsers.add_parser("explain", help="what a property (P1-P8) or invariant (I1-I7) asserts, why, and a bug it catches",
                              description="Print the reference text of a property or invariant a failure names (P1/I3 -> I3). "
                                          "Without an id: list them.")
    s.add_argument("id", nargs="?", help="P1..P8, I1..I7 or padding (any case)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_explain)
