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
from collections.abc import Iterable
from pathlib import Path


def link_tree(src: Path, dst: Path, edited: Iterable[str]) -> Path:
    """dst made a view of src through symlinks; each path in `edited` (relative to src) is a symlink in a real directory,
    for the caller to replace with its edited text (unlink, then write)."""
    wanted = [Path(rel).parts for rel in edited]
    _link_dir(src, dst, (), wanted)
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
