"""A JSON Schema for case files, generated from the loader's own tables (harness/cases/case.py).

Editors (taplo, Even Better TOML, VS Code) validate and complete TOML against a JSON Schema;
`harness case-schema > case.schema.json` writes it. The loader stays the authority: rules that
span fields (divisibility, the schedule's shape per DP group, the resource budget) are checked
there, with a message naming the field; the schema carries types, ranges and the known keys.
"""
from __future__ import annotations

from typing import Any

from harness.cases.budget import MAX_ITERATIONS
from harness.cases.case import (
    _LAYOUT,
    _MODEL,
    _MODEL_RANGES,
    _PY,
    _REQUIRED,
    _SCHEDULE,
    _SPEC,
    _SPEC_MAX,
    _TOL,
    _TOP,
    GOLDEN_FLOAT_FIELDS,
    NAME_RE,
    PAGE_SIZES,
)
from runners.attention.kinds import AttentionBackend
from runners.config import DTYPES, SPEC_OPTIONS, DraftExtendGraph
from runners.draft_decode import DRAFTS

_JSON_TYPE = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


def _leaf(t: Any) -> dict:
    t = _PY.get(t, t) if isinstance(t, str) else t
    return {"type": _JSON_TYPE[t]}


def _table(schema: dict, extra: dict | None = None, required: tuple = ()) -> dict:
    props = {k: _leaf(t) for k, t in schema.items()}
    for k, v in (extra or {}).items():
        props[k] = {**props.get(k, {}), **v}
    out = {"type": "object", "additionalProperties": False, "properties": props}
    if required:
        out["required"] = list(required)
    return out


def case_json_schema() -> dict:
    tol = _table(_TOL, {"rtol": {"minimum": 0}, "atol": {"minimum": 0}}, required=("rtol", "atol"))
    int_list3 = {"type": "array", "items": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}}
    model = _table(_MODEL, {k: {"minimum": lo, "maximum": hi} for k, (lo, hi) in _MODEL_RANGES.items()}
                   | {"rope_theta": {"exclusiveMinimum": 0}, "rms_eps": {"exclusiveMinimum": 0}})
    spec = _table(_SPEC, {k: {"minimum": 1, "maximum": hi} for k, hi in _SPEC_MAX.items()}
                  | {"capture_bs": {"minItems": 1, "items": {"type": "integer", "minimum": 1, "maximum": 1024}},
                     "page_size": {"enum": list(PAGE_SIZES)}, "draft": {"enum": list(DRAFTS)},
                     "draft_extend_graph": {"enum": [g.value for g in DraftExtendGraph]}}
                  | {k: {"enum": [o.value for o in enum]} for k, enum in SPEC_OPTIONS.items()})
    layout = _table(_LAYOUT, {"tp_size": {"minimum": 1, "maximum": 64}, "dp_size": {"minimum": 1, "maximum": 64},
                              "moe_a2a_backend": {"enum": ["none", "deepep", "mooncake", "flashinfer"]}}, required=("tp_size",))
    schedule = _table(_SCHEDULE, {"batches": {"minItems": 1, "maxItems": MAX_ITERATIONS,
                                              "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}},
                                  "max_prefix_len": {"minimum": 1}, "prefix_lens": int_list3, "accept_lens": int_list3, "rids": int_list3,
                                  "top_logprobs_num": {"minimum": 0, "maximum": 20}},
                      required=("batches",))
    tolerances = _table({k: dict for k in ("eager_vs_graph", "cross_layout", "golden")},
                        {"eager_vs_graph": tol, "cross_layout": tol,
                         "golden": {"type": "object", "additionalProperties": False, "properties": {f: tol for f in GOLDEN_FLOAT_FIELDS}}})
    top = _table(_TOP, {"name": {"pattern": f"^{NAME_RE.pattern}$"}, "seed": {"minimum": 0, "maximum": 2**31 - 1},
                        "dtype": {"enum": sorted(DTYPES)}, "backend": {"enum": [b.value for b in AttentionBackend]},
                        "model": model, "spec": spec, "layout": layout, "schedule": schedule, "tolerances": tolerances},
                 required=_REQUIRED)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://specharness/case.schema.json",
            "title": "specharness case file (cases/<name>.toml)", **top}
