"""harness/engines/lazy_compile.py: an engine's torch.compile / torch.compiler.disable decorations wait for a first call."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from harness.engines import lazy_compile

REPO = Path(__file__).resolve().parent.parent


class RecordingDecorator:
    """Stands for torch.compile: records each decoration and wraps the function so its result is negated."""

    def __init__(self) -> None:
        self.decorated: list[tuple] = []

    def __call__(self, model=None, *, dynamic=None, mode=None):
        if model is None:
            return lambda f: self(f, dynamic=dynamic, mode=mode)
        self.decorated.append((model, dynamic, mode))
        return lambda *a, **k: -model(*a, **k)


def _module(name: str, source: str, **names) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(names)
    exec(textwrap.dedent(source), mod.__dict__)
    return mod


@pytest.fixture
def engine_packages(monkeypatch):
    monkeypatch.setattr(lazy_compile, "_ENGINE_PACKAGES", {"fakeengine"})


def test_an_engine_modules_decoration_waits_for_the_first_call_then_is_the_real_one(engine_packages):
    real = RecordingDecorator()
    mod = _module("fakeengine.layers.mod", """
        @compile(dynamic=True)
        def double(x):
            '''twice x'''
            return 2 * x

        def triple(x):
            return 3 * x

        triple_compiled = compile(triple, mode="max")
        by_keyword = compile(model=triple)
        """, compile=lazy_compile.deferring(real))
    assert real.decorated == []  # nothing decorated at import
    assert mod.double.__doc__ == "twice x" and mod.double.__name__ == "double"
    assert mod.double(5) == -10  # the real decoration's behaviour from the first call on
    assert mod.double(7) == -14
    assert [(f.__name__, d, m) for f, d, m in real.decorated] == [("double", True, None)]  # decorated once, with its options
    assert mod.triple_compiled(2) == -6 and mod.by_keyword(1) == -3
    assert [(f.__name__, d, m) for f, d, m in real.decorated[1:]] == [("triple", None, "max"), ("triple", None, None)]


def test_other_callers_and_non_functions_get_the_real_decoration_at_once(engine_packages):
    real = RecordingDecorator()
    deferred = lazy_compile.deferring(real)

    def f(x):
        return x

    assert deferred(f)(4) == -4 and len(real.decorated) == 1  # called from here (tests), not from the engine's package

    class Model:
        def __call__(self, x):
            return x + 1

    model = Model()
    mod = _module("fakeengine.mod", "compiled_model = compile(model)", compile=deferred, model=model)
    assert real.decorated[-1][0] is model  # an object, not a plain function: decorated at import
    assert mod.compiled_model(1) == -2
    _module("otherpkg.mod", "g = compile(lambda x: x)", compile=deferred)
    assert len(real.decorated) == 3


def test_defer_swaps_torch_compile_so_an_engine_import_needs_no_dynamo():
    """In a fresh interpreter (torch._dynamo is imported by then in a test process): the engine's decorations import
    neither TorchDynamo nor Inductor, and a decorated function called still runs through torch.compile."""
    code = textwrap.dedent("""
        import sys, types, torch
        from harness.engines import lazy_compile
        lazy_compile.defer("fakeengine")
        mod = types.ModuleType("fakeengine.kernels")
        exec('''
        import torch
        @torch.compile(backend="eager")
        def add_one(x):
            return x + 1
        @torch.compiler.disable
        def plain(x):
            return x * 2
        ''', mod.__dict__)
        assert "torch._dynamo" not in sys.modules and "torch._inductor.compile_fx" not in sys.modules, "imported at decoration"
        assert mod.add_one(torch.ones(2)).tolist() == [2.0, 2.0] and mod.plain(torch.ones(1)).tolist() == [2.0]
        assert "torch._dynamo" in sys.modules, "the first call did not decorate for real"
        print("ok")
        """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
