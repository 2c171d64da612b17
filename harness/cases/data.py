"""Where the shipped cases and goldens are: the repo's folders, or the wheel's package data.

A source checkout (or an editable install) reads `cases/` and `golden/` at the repo root, so
what is committed is what runs. A wheel has no repo root: setup.py's build step copies the
same folders into `harness/_data/`, found here through importlib.resources. One copy of each
file is committed; the wheel's is built from it.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Optional

_REPO = Path(__file__).resolve().parents[2]
PACKAGED = "_data"  # harness/_data/{cases,golden} inside a wheel (setup.py)
KINDS = ("cases", "golden")


def package_dir() -> Path:
    """The `harness` package's own directory: in a wheel, site-packages/harness (its shipped data included)."""
    return Path(__file__).resolve().parents[1]


def checkout_root() -> Optional[Path]:
    """The source checkout this harness runs from (an editable install included), or None for an installed wheel."""
    return _REPO if _is_checkout(_REPO) else None


def _is_checkout(root: Path) -> bool:
    return (root / "pyproject.toml").is_file() and (root / "harness" / "__init__.py").is_file()


def shipped_dir(kind: str) -> Path:
    """The default `cases` or `golden` directory: the checkout's, else the installed package's.

    The path is returned even where it does not exist, so an error can say where it looked.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if _is_checkout(_REPO):
        return _REPO / kind
    return Path(str(resources.files("harness").joinpath(PACKAGED, kind)))
