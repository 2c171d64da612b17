"""What a golden was made from: the case config, the weights, the versions; the refusal says what changed."""
from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import asdict, dataclass

import numpy as np
import torch

from harness.cases.case import Case

# ----------------------------------------------------------------------------------------
# fingerprints
# ----------------------------------------------------------------------------------------


def case_config(case: Case) -> dict:
    """Everything that decides a golden's contents (not the name, description or tolerances)."""
    sc = case.scenario
    spec = sc.spec
    return {
        "model": asdict(sc.model),
        "spec": {"num_steps": spec.num_steps, "topk": spec.topk, "num_tokens_per_bs": spec.num_tokens_per_bs,
                 "capture_bs": list(spec.capture_bs), "max_running_requests": spec.max_running_requests, **spec.draft_fields()},
        "layout": asdict(sc.layout),
        "seed": sc.seed,
        "backend": sc.attention_backend,
        "dtype": sc.model.dtype,
        "schedule": [[[[r.rid, r.prefix_len, r.accept_len] for r in group] for group in it.per_dp] for it in sc.iterations],
    }


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def weights_fingerprint(case: Case) -> str:
    """Hash of the draft model's full (TP1) weights: code that changes the weights changes it."""
    from runners.config import DraftKind, draft_model_config
    from runners.llama_eagle3 import Eagle3DraftModel
    from runners.model import DraftModel
    from runners.parallel.dp_attention import RankContext
    from runners.parallel.layout import ParallelLayout

    sc, ctx = case.scenario, RankContext(ParallelLayout(), 0, comm=None)
    if sc.spec.draft is DraftKind.EAGLE3:  # the case's own draft model (the others hash the multi-layer draft's, as recorded)
        m = Eagle3DraftModel(draft_model_config(sc.model, sc.spec), sc.spec, ctx)
    else:
        m = DraftModel(sc.model, sc.spec.num_steps, ctx)
    h = hashlib.sha256()

    def walk(obj, prefix: str) -> None:
        for name in sorted(vars(obj)):
            val = getattr(obj, name)
            if isinstance(val, torch.Tensor):
                h.update(f"{prefix}{name}:{tuple(val.shape)}:{val.dtype}".encode())
                h.update(val.detach().contiguous().view(torch.uint8).numpy().tobytes() if val.numel() else b"")
            elif isinstance(val, list):
                for i, x in enumerate(val):
                    if hasattr(x, "__dict__"):
                        walk(x, f"{prefix}{name}[{i}].")
            elif hasattr(val, "__dict__") and name in ("head", "layer"):
                walk(val, f"{prefix}{name}.")

    walk(m, "")
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Fingerprint:
    model: str
    weights: str
    config: str
    config_dict: dict


def fingerprint(case: Case) -> Fingerprint:
    cfg = case_config(case)
    return Fingerprint(case.scenario.model.fingerprint(), weights_fingerprint(case), sha256_hex(json.dumps(cfg, sort_keys=True).encode())[:16], cfg)


def _flat(d, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    else:
        out[prefix] = d
    return out


def config_changes(old: dict, new: dict, limit: int = 6) -> list[str]:
    """'model.hidden_size 64 -> 128', 'schedule[1] batch [3] -> [2]', ... (first `limit`)."""
    old, new = dict(old), dict(new)
    s_old, s_new = old.pop("schedule", []), new.pop("schedule", [])
    a, b = _flat(old), _flat(new)
    changes = [f"{k} {a.get(k, '<unset>')} -> {b.get(k, '<unset>')}" for k in sorted(set(a) | set(b)) if a.get(k, "<unset>") != b.get(k, "<unset>")]
    if len(s_old) != len(s_new):
        changes.append(f"schedule: {len(s_old)} -> {len(s_new)} iterations")
    for i, (x, y) in enumerate(zip(s_old, s_new, strict=False)):  # a length change is reported above
        if [len(g) for g in x] != [len(g) for g in y]:
            changes.append(f"schedule[{i}] batch {[len(g) for g in x]} -> {[len(g) for g in y]}")
        elif x != y:
            changes.append(f"schedule[{i}] requests (rid, prefix_len, accept_len) {x} -> {y}")
    if len(changes) > limit:
        changes = changes[:limit] + [f"... and {len(changes) - limit} more"]
    return changes


def versions() -> dict[str, str]:
    try:
        from importlib.metadata import version

        ours = version("specharness")
    except Exception:  # noqa: BLE001 - an uninstalled checkout
        ours = "unknown"
    return {"specharness": ours, "torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version(),
            "machine": platform.machine()}

