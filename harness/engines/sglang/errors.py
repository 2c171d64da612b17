"""What the SGLang adapter raises when a release is not something it can drive (engine-check exit 2)."""
from __future__ import annotations

from typing import Any


class EngineAdapterError(RuntimeError):
    """The installed engine does not look like anything this adapter knows how to drive."""


class ReleaseNotCovered(EngineAdapterError):
    """The release is outside what the adapter claims: it does not carry the code path the adapter
    checks, or carries it in an older API the adapter's rules were not written for. engine-check's
    verdict is n/a (exit 3) with the reason: neither a pass nor an adapter that fell behind."""


class MissingEngineAttribute(AttributeError):
    """The engine read an attribute that our stand-in does not provide (a release moved something)."""


def require(obj: Any, name: str, version: str, what: str = "") -> Any:
    """getattr that names the release and the attribute when a release moved it."""
    try:
        return getattr(obj, name)
    except AttributeError:
        owner = getattr(obj, "__name__", type(obj).__name__)
        raise EngineAdapterError(
            f"sglang {version}: {owner}.{name} not found{(' (' + what + ')') if what else ''}; "
            f"this release moved it: teach harness/engines/sglang where it went"
        ) from None
