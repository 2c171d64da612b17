"""Every property, found in harness/props/: the one list `harness check`, `harness replay`, the pytest plugin, the mutant
runner and the docs read.

A module of this package that defines a `Property` (harness.props.base) is a property: adding one is adding its
module (and its tests). The registry imports every module of the package once, on first use, and orders the
properties by id (P1, P2, ..., P10, then named ones).
"""
from __future__ import annotations

import contextlib
import importlib
import pkgutil
import re
from typing import Iterable, Iterator, Optional

import harness.props
from harness.props.base import Needs, Probe, Property
from harness.run.case_run import RUN

_found: Optional[dict[str, Property]] = None
_extra: dict[str, Property] = {}  # registered by hand (a test's throwaway property)


def _sort_key(prop_id: str) -> tuple:
    m = re.fullmatch(r"P(\d+)", prop_id)
    return (0, int(m.group(1)), "") if m else (1, 0, prop_id)


def _discover() -> dict[str, Property]:
    found: dict[str, Property] = {}
    for info in pkgutil.iter_modules(harness.props.__path__):
        module = importlib.import_module(f"{harness.props.__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, Property):
                other = found.setdefault(value.id, value)
                if other is not value:
                    raise ImportError(f"two properties share the id {value.id!r}: {other.title!r} and {value.title!r}")
    return found


def properties() -> tuple[Property, ...]:
    global _found
    if _found is None:
        _found = _discover()
    clash = set(_found) & set(_extra)
    if clash:
        raise ValueError(f"property id(s) {', '.join(sorted(clash))} registered twice")
    every = {**_found, **_extra}
    return tuple(every[k] for k in sorted(every, key=_sort_key))


def register(prop: Property) -> Property:
    """Add a property that has no module here (a plugin's, a test's); its id must be new."""
    if prop.id in {p.id for p in properties()}:
        raise ValueError(f"property {prop.id!r} is registered already")
    _extra[prop.id] = prop
    return prop


@contextlib.contextmanager
def registered(prop: Property) -> Iterator[Property]:
    """`prop` in the registry for the block only."""
    register(prop)
    try:
        yield prop
    finally:
        del _extra[prop.id]


def get(prop_id: str) -> Property:
    for p in properties():
        if p.id == prop_id:
            return p
    raise KeyError(f"unknown property {prop_id!r}; known: {', '.join(p.id for p in properties())}")


def ids(props: Optional[tuple[Property, ...]] = None) -> tuple[str, ...]:
    return tuple(p.id for p in (properties() if props is None else props))


def case_properties() -> tuple[Property, ...]:
    """The properties a case check can run (`--props all`)."""
    return tuple(p for p in properties() if p.per_case)


def default_ids() -> tuple[str, ...]:
    """What a case check runs unless told otherwise: the properties of one run of the case's runners."""
    return tuple(p.id for p in case_properties() if p.one_run)


def case_ids() -> tuple[str, ...]:
    """Every property a case check can run: those of one run first (the default), then the others."""
    return default_ids() + tuple(p.id for p in case_properties() if not p.one_run)


def loop_ids() -> tuple[str, ...]:
    return tuple(p.id for p in case_properties() if Needs.LOOP in p.needs)


def elsewhere() -> tuple[Property, ...]:
    """The properties with runs of their own (no case check)."""
    return tuple(p for p in properties() if not p.per_case)


def elsewhere_note() -> str:
    """One line for `--props`: what a case check does not run, and where it runs."""
    return "; ".join(f"{p.id} ({p.title}) runs under {p.runs_under}" for p in elsewhere())


def props_help() -> str:
    one_run = ",".join(default_ids())
    loop = ",".join(loop_ids())
    return (f"properties per case: a comma list of {one_run} (one run of the runners; the default) and {loop} (the case's "
            f"workload through the speculative decoding loop; simulated ranks), or 'all' (every one of them). Not per case: "
            f"{elsewhere_note()}")


def parse_props(text: Optional[str]) -> tuple[str, ...]:
    """`all`, a comma list of case properties, or None / "" (the default); anything else names what is accepted."""
    if not text:
        return default_ids()
    known = case_ids()
    if text.strip().lower() == "all":
        return known
    props = tuple(p.strip().upper() for p in text.split(",") if p.strip())
    bad = [p for p in props if p not in known]
    if bad or not props:
        raise ValueError(f"--props {text!r}: expected 'all' or a comma list of {', '.join(known)}; "
                         f"{'unknown: ' + ', '.join(bad) if bad else 'none given'} (not per case: {elsewhere_note()})")
    return tuple(dict.fromkeys(props))


def report_order() -> tuple[str, ...]:
    """How a case reports: "run" (every rank finished, the collectives agreed) first, then by property."""
    return (RUN,) + ids()


def kill_order() -> tuple[str, ...]:
    """Which property a mutant's kill is put on: the first that failed; "run" (a rank crashed or desynced) last, so a
    property that saw the bug itself is named before the crash it caused."""
    return ids() + (RUN,)


def probes() -> tuple[Probe, ...]:
    """Every property's probes and their parts (Probe.of), in registry order; ids unique."""
    return unique_probes(probe for p in properties() for probe in p.probes)


def unique_probes(top: Iterable[Probe]) -> tuple[Probe, ...]:
    """The probes and their parts at every depth, each once (a part shared by two probes is one probe); two different
    probes under one id are an error."""
    seen: dict[str, Probe] = {}
    twice: list[str] = []
    for probe in (p for t in top for p in t.flat()):
        if seen.setdefault(probe.id, probe) is not probe:
            twice.append(probe.id)
    if twice:
        raise ValueError("two probes share an id: " + ", ".join(dict.fromkeys(twice)))
    return tuple(seen.values())


def markdown() -> str:
    """The properties and P1's invariants as reference tables (the docs are generated from them)."""
    rows = ["| id | property | needs | runs under | mutant probes |", "|---|---|---|---|---|"]
    for p in properties():
        needs = ", ".join(n.name.lower().replace("_", " ") for n in Needs if n in p.needs)
        where = p.runs_under or ("`harness check`, `harness replay`, the pytest plugin" if p.one_run else
                                 f"`harness check --props {p.id}`, the pytest plugin")
        rows.append(f"| {p.id} | {p.title} | {needs} | {where} | {', '.join(x.id for x in p.probes) or '-'} |")
    inv = [(p.id, i) for p in properties() for i in p.invariants]
    if inv:
        rows += ["", "| invariant | of | what holds |", "|---|---|---|"] + [f"| {i.id} | {pid} | {i.title} |" for pid, i in inv]
    return "\n".join(rows) + "\n"


# The public names, read from the registry when first asked (module __getattr__ below): importing this module
# discovers no property.
FAST_PROPS: tuple[str, ...]
"""The properties one run of a case's graph runners decides: what `harness check` runs by default."""
CASE_PROPS: tuple[str, ...]
"""Every property a single case can run (`--props all`): those of one run, then the loop's. P7 and P8 need planned
schedules, so the test suite and the mutant catalog run them instead."""
LOOP_PROPS: tuple[str, ...]
"""The properties that drive the case's workload through the speculative decoding loop (simulated ranks only)."""


def __getattr__(name: str) -> tuple[str, ...]:
    """FAST_PROPS, CASE_PROPS and LOOP_PROPS (the public names), read from the registry when asked."""
    if name == "FAST_PROPS":
        return default_ids()
    if name == "CASE_PROPS":
        return case_ids()
    if name == "LOOP_PROPS":
        return loop_ids()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
