"""harness/engines/launch_memo.py and its use by the interpreter (interpreter.py): a launch on exactly the state a clean
launch ran on writes back that launch's effect; any difference in what the kernel can read runs it; a launch the key
cannot see all of (through a pointer table, out of bounds, a computed grid) always runs."""
from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Optional

import pytest
import torch

from harness.engines.launch_memo import LaunchMemo, launch_state
from harness.engines.shared_memo import SHARED_MEMO_ENV
from tests.helpers.prewarmed import Started, run_python


def _launch(memo: LaunchMemo, runs: list[int], context: str, dst: torch.Tensor, src: torch.Tensor, n: int, bias: float = 0.0,
            folder: Optional[Path] = None) -> None:
    """dst[:n] = src[:n] + bias, through the memo as the interpreter calls it (with a shared folder: this process's
    effects first, then the folder's file, named only then)."""
    key, storages = memo.key(context, (dst, src, n), {"bias": bias})
    shared = None
    if key is not None:
        if memo.replay(key, storages):
            return
        shared = None if folder is None else memo.shared_file(folder, context, key)
        if shared is not None and memo.replay(key, storages, shared):
            return
    runs.append(n)
    dst[:n] = src[:n] + bias
    if key is not None:
        memo.record(key, storages, shared)


def test_an_equal_state_gets_the_first_launchs_bytes_and_any_difference_runs_again():
    memo, runs = LaunchMemo(), []
    dst, src = torch.full((4,), 9.0), torch.tensor([1.0, 2.0, 3.0, 4.0])
    _launch(memo, runs, "k", dst, src, 2, 0.5)
    assert dst.tolist() == [1.5, 2.5, 9.0, 9.0] and runs == [2]
    dst2, src2 = torch.full((4,), 9.0), torch.tensor([1.0, 2.0, 3.0, 4.0])  # other tensors, equal bytes
    _launch(memo, runs, "k", dst2, src2, 2, 0.5)
    assert runs == [2] and memo.hits == 1 and dst2.tolist() == [1.5, 2.5, 9.0, 9.0] and src2.tolist() == [1.0, 2.0, 3.0, 4.0]
    # the read-only source is kept as None (left as it was): only what the launch changed is written back
    [after] = memo.effects.values()
    assert after[1] is None and after[0] is not None
    differing = [
        ("another kernel", lambda: _launch(memo, runs, "k2", torch.full((4,), 9.0), torch.tensor([1.0, 2.0, 3.0, 4.0]), 2, 0.5)),
        ("one byte of the source", lambda: _launch(memo, runs, "k", torch.full((4,), 9.0), torch.tensor([1.0, 2.0, 3.0, 5.0]), 2, 0.5)),
        ("one byte of the destination", lambda: _launch(memo, runs, "k", torch.tensor([9.0, 9.0, 9.0, 8.0]), torch.tensor([1.0, 2.0, 3.0, 4.0]), 2, 0.5)),
        ("an integer argument", lambda: _launch(memo, runs, "k", torch.full((4,), 9.0), torch.tensor([1.0, 2.0, 3.0, 4.0]), 3, 0.5)),
        ("-0.0 for 0.0", lambda: _launch(memo, runs, "k", torch.full((4,), 9.0), torch.tensor([1.0, 2.0, 3.0, 4.0]), 2, -0.0)),
        ("a view at another offset", lambda: _launch(memo, runs, "k", torch.full((5,), 9.0)[1:], torch.tensor([1.0, 2.0, 3.0, 4.0]), 2, 0.5)),
        ("another stride", lambda: _launch(memo, runs, "k", torch.full((8,), 9.0)[::2], torch.tensor([1.0, 2.0, 3.0, 4.0]), 2, 0.5)),
    ]
    for what, launch in differing:
        before = len(runs)
        launch()
        assert len(runs) == before + 1, what
    assert memo.hits == 1


def test_arguments_sharing_a_storage_key_differently_from_two_equal_storages():
    shared = torch.tensor([1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0])
    a, b = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 2.0, 3.0, 4.0])
    key_shared, storages_shared = launch_state((shared[4:], shared[:4]), {})
    key_two, storages_two = launch_state((a, b), {})
    assert len(storages_shared) == 1 and len(storages_two) == 2 and key_shared != key_two


def test_what_the_key_cannot_hold_is_not_keyed_and_the_byte_budget_stops_keeping():
    assert launch_state((torch.zeros(2), object()), {}) == (None, [])
    assert launch_state((torch.zeros(2, device="meta"),), {}) == (None, [])
    memo, runs = LaunchMemo(max_bytes=40), []
    _launch(memo, runs, "k", torch.zeros(4), torch.ones(4), 4)  # 16 + 16 bytes before, 16 changed: 48 > 40
    assert memo.effects == {} and memo.held == 0
    _launch(memo, runs, "k", torch.zeros(4), torch.ones(4), 4)
    assert runs == [4, 4] and memo.hits == 0


def test_interpreted_launches_replay_only_where_the_key_sees_everything_the_kernel_read():
    """Under prepare_interpreter(): a kernel launched again on other tensors with equal bytes is replayed (its output
    as computed by hand); one reading through a pointer table, one with a lane masked off as out of bounds (reported
    at every launch), one that stores an argument's address, one that prints, and one with a grid computed by a function are interpreted
    every time."""
    proc = run_python(textwrap.dedent("""
        import json, numpy as np, torch, triton, triton.language as tl
        from harness.engines import interpreter
        interpreter.prepare_interpreter()

        @triton.jit
        def scale(x_ptr, out_ptr, n, k, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n, other=0) * k, mask=offs < n)

        @triton.jit
        def through_table(table_ptr, BLOCK: tl.constexpr):
            dst = tl.cast(tl.load(table_ptr), tl.pointer_type(tl.int32))
            offs = tl.arange(0, BLOCK)
            tl.store(dst + offs, offs + 1, mask=offs < BLOCK)

        @triton.jit
        def address_of(x_ptr, out_ptr):
            tl.store(out_ptr, tl.cast(x_ptr, tl.int64))

        @triton.jit
        def printing(x_ptr):
            tl.device_print("x", tl.load(x_ptr))

        got = {}
        def hits_after(name, launch, times=2):
            h, mark = interpreter.MEMO.hits, len(interpreter.VIOLATIONS)
            outs = [launch() for _ in range(times)]
            got[name] = {"hits": interpreter.MEMO.hits - h, "violations": len(interpreter.VIOLATIONS) - mark, "outs": outs}
            del interpreter.VIOLATIONS[mark:]

        def scaled(n=6, grid=(2,)):
            x, out = torch.arange(8, dtype=torch.int32), torch.full((8,), -1, dtype=torch.int32)
            scale[grid](x, out, n, 3, BLOCK=4)
            return out.tolist()
        hits_after("equal", scaled)
        hits_after("computed grid", lambda: scaled(grid=lambda meta: (2,)))
        hits_after("out of bounds", lambda: scaled(n=9, grid=(3,)))
        target = torch.zeros(8, dtype=torch.int32)
        def tabled():
            target.zero_()
            through_table[(1,)](torch.tensor([target.data_ptr()], dtype=torch.uint64), BLOCK=8)
            return target.tolist()
        hits_after("pointer table", tabled)
        alive = []
        def addressed():
            x, out = torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
            alive.append(x)  # each launch its own x: equal bytes, another address
            address_of[(1,)](x, out)
            return out.item() == x.data_ptr()
        hits_after("address", addressed)
        import contextlib, io
        def printed():
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                printing[(1,)](torch.tensor([7], dtype=torch.int32))
            return out.getvalue().count("7")
        hits_after("print", printed)
        print(json.dumps(got))
    """), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["equal"] == {"hits": 1, "violations": 0, "outs": [[0, 3, 6, 9, 12, 15, -1, -1]] * 2}
    assert got["computed grid"] == {"hits": 0, "violations": 0, "outs": [[0, 3, 6, 9, 12, 15, -1, -1]] * 2}
    # lane 8 (program 2) reads and writes one element past both 8-element storages: masked off, reported each time
    assert got["out of bounds"]["hits"] == 0 and got["out of bounds"]["violations"] >= 2
    assert got["out of bounds"]["outs"] == [[0, 3, 6, 9, 12, 15, 18, 21]] * 2
    assert got["pointer table"] == {"hits": 0, "violations": 0, "outs": [list(range(1, 9))] * 2}
    assert got["address"] == {"hits": 0, "violations": 0, "outs": [True, True]}
    assert got["print"] == {"hits": 0, "violations": 0, "outs": [1, 1]}


# ---- the memo shared by processes ($SPECHARNESS_LAUNCH_MEMO_DIR) ----


def test_a_shared_folder_hands_an_effect_to_another_process_memo_and_any_difference_misses(tmp_path):
    folder = tmp_path / "memo"
    first, runs = LaunchMemo(), []
    _launch(first, runs, "kernel k", torch.zeros(4), torch.tensor([1.0, 2.0, 3.0, 4.0]), 2, 10.0, folder)
    assert runs == [2] and len(list(folder.iterdir())) == 1
    other, dst = LaunchMemo(), torch.zeros(4)  # another process's memo: nothing of its own, the same folder
    _launch(other, runs, "kernel k", dst, torch.tensor([1.0, 2.0, 3.0, 4.0]), 2, 10.0, folder)
    assert runs == [2] and dst.tolist() == [11.0, 12.0, 0.0, 0.0] and (other.hits, other.shared_hits) == (1, 1)
    _launch(other, runs, "kernel k", torch.zeros(4), torch.tensor([1.0, 2.0, 3.0, 4.0]), 2, 10.0, folder)  # now its own
    assert runs == [2] and (other.hits, other.shared_hits) == (2, 1)
    _launch(LaunchMemo(), runs, "kernel k2", torch.zeros(4), torch.tensor([1.0, 2.0, 3.0, 4.0]), 2, 10.0, folder)  # another kernel's text
    _launch(LaunchMemo(), runs, "kernel k", torch.zeros(4), torch.tensor([1.0, 2.0, 3.0, 5.0]), 2, 10.0, folder)  # one byte of its input
    assert runs == [2, 2, 2] and len(list(folder.iterdir())) == 3
    for path in folder.iterdir():
        path.write_bytes(b"not an effect")
    with pytest.raises(RuntimeError, match=r"\.effect: not a launch effect of 2 storage\(s\)"):
        _launch(LaunchMemo(), runs, "kernel k", torch.zeros(4), torch.tensor([1.0, 2.0, 3.0, 4.0]), 2, 10.0, folder)


_KERNEL = """import triton
import triton.language as tl

from pkg.consts import SCALE
from pkg.helpers import shift


@triton.jit
def scale(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, shift(tl.load(x_ptr + offs, mask=offs < n, other=0) * SCALE), mask=offs < n)


@triton.jit
def through_module(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n, other=0) * consts.SCALE, mask=offs < n)


import pkg.consts as consts  # noqa: E402
"""
# the language imported, as a kernel's module has it: the interpreter runs a kernel with the language its globals hold
_HELPERS = "import triton\nimport triton.language as tl  # noqa: F401\n\n\n@triton.jit\ndef shift(x):\n    return x + 1\n"
_CONSTS = "import triton.language as tl\n\nSCALE = tl.constexpr(3)\n"

_LAUNCH = """
import json, sys, torch
sys.path.insert(0, {root!r})
from harness.engines import interpreter
interpreter.prepare_interpreter()
from pkg.kern import {kernel}
x, out = torch.arange(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
{kernel}[(2,)](x, out, 8, BLOCK=4)
print(json.dumps({{"out": out.tolist(), "shared": interpreter.MEMO.shared_hits}}))
"""


def test_processes_share_a_kernels_launch_only_where_every_file_and_global_it_reads_is_the_same(tmp_path):
    """A release's kernel, launched by another process on equal inputs, is read from the shared folder; a copy with the
    same files elsewhere shares it too; one whose helper (another file) or whose constant (another file) was planted
    runs and writes its own; a kernel reading an engine module's attribute is never shared (shared_memo.py)."""
    folder = tmp_path / "memo"

    def tree(name: str, helpers: str = _HELPERS, consts: str = _CONSTS) -> str:
        pkg = tmp_path / name / "pkg"
        pkg.mkdir(parents=True)
        for file, text in (("__init__.py", ""), ("kern.py", _KERNEL), ("helpers.py", helpers), ("consts.py", consts)):
            (pkg / file).write_text(text)
        return str(tmp_path / name)

    def launched(root: str, kernel: str = "scale", env_folder=folder) -> dict:
        env = {k: v for k, v in os.environ.items() if k != SHARED_MEMO_ENV} | ({SHARED_MEMO_ENV: str(env_folder)} if env_folder else {})
        proc = Started(_LAUNCH.format(root=root, kernel=kernel), env=env).result(300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    release, copy = tree("release"), tree("copy")
    planted_helper, planted_const = tree("helper", helpers=_HELPERS.replace("x + 1", "x + 2")), tree("const", consts=_CONSTS.replace("(3)", "(4)"))
    right = [3 * i + 1 for i in range(8)]
    assert launched(release) == {"out": right, "shared": 0} and len(list(folder.iterdir())) == 1
    assert launched(copy) == {"out": right, "shared": 1}  # the same text at other paths: the same kernel
    assert launched(planted_helper) == {"out": [3 * i + 2 for i in range(8)], "shared": 0}
    assert launched(planted_const) == {"out": [4 * i + 1 for i in range(8)], "shared": 0}
    assert len(list(folder.iterdir())) == 3
    assert launched(release, "through_module") == {"out": [3 * i for i in range(8)], "shared": 0}
    assert launched(release, "through_module") == {"out": [3 * i for i in range(8)], "shared": 0}
    assert len(list(folder.iterdir())) == 3  # an engine module's attribute: no identity, nothing written
    assert launched(release, env_folder=None) == {"out": right, "shared": 0}  # no folder set: this process's memo only
