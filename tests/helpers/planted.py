"""A copy of an installed engine release to plant a bug into: every file reads as the release's, through symlinks, except
the ones the test rewrites.

A release holds thousands of files (SGLang 0.5.23 about 7000); linking each one cost more CPU than the check of a small
planted copy. Here only the directories on the way to an edited file are real: each holds a symlink per other entry
(a whole subtree is one link) and a `__pycache__` of its own whose entries link to the release's, so Python writes the
bytecode of an edited file into the copy, never over the release's. A module resolves to the release's file as it did when
every file was a link of its own, an edited one to the copy's.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path


def planted_copy(src: Path, dst: Path, edits: Mapping[str, str]) -> Path:
    """dst made a view of src through symlinks, with each file in `edits` (a path relative to src -> its new text) a real
    file holding that text. Write nothing else under dst: any other path there may lead into the release itself."""
    wanted = [Path(rel).parts for rel in edits]
    _link_dir(src, dst, (), wanted)
    for rel, text in edits.items():
        path = dst / rel
        assert not path.parent.resolve().is_relative_to(src.resolve()), f"{rel}: its directory would be the release's"
        path.unlink()
        path.write_text(text)
    return dst


def _link_dir(src: Path, dst: Path, at: tuple[str, ...], wanted: list[tuple[str, ...]]) -> None:
    here, there = src.joinpath(*at), dst.joinpath(*at)
    there.mkdir(parents=True, exist_ok=True)
    deeper = {parts[len(at)] for parts in wanted if parts[:len(at)] == at and len(parts) > len(at) + 1}  # dirs on an edited path
    for entry in os.scandir(here):
        if entry.name in deeper and entry.is_dir(follow_symlinks=False):
            _link_dir(src, dst, (*at, entry.name), wanted)
        elif entry.name == "__pycache__" and entry.is_dir(follow_symlinks=False):
            shutil.copytree(entry.path, there / entry.name, symlinks=True, copy_function=os.symlink)
        else:
            os.symlink(entry.path, there / entry.name)
