"""Import stubs: SGLang's runner modules import ~24 third-party packages we never exercise.

A meta-path finder serves package-like stub modules whose attributes are real, subclassable
classes (instances are falsy and absorb calls and attribute reads; a stub called on a
function returns it, so decorators work). Only the listed names are stubbed, and always,
even where the host has them installed, so a check does not depend on what else the
machine has; anything else missing still raises ImportError (SGLang probes optional kernels
with try/except ImportError and must keep seeing them absent). REAL_MODULES are imported
for real (msgspec structs, triton.jit, regex, dill, packaging at import time);
harness/engines/install.py provides them.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import types
from typing import Any, Iterator, Optional

# Imported for real: the runner modules use them at import time.
REAL_MODULES = ("triton", "msgspec", "regex", "dill", "packaging")

# Third-party top-level imports of the modules we load, stubbed. Found by importing the
# runner modules with nothing but torch, numpy and REAL_MODULES available (0.5.12.post1 ..
# 0.5.23). A release that imports a new one fails with ModuleNotFoundError naming it: add
# it here.
STUBBED_MODULES = (
    "aiohttp", "compressed_tensors", "einops", "fastapi", "gguf", "huggingface_hub", "IPython",
    "openai", "orjson", "yaml", "partial_json_parser", "PIL", "psutil", "pybase64", "pydantic",
    "pydantic_core", "requests", "safetensors", "sentencepiece", "setproctitle", "starlette",
    "torchao", "torchvision", "tqdm", "transformers", "tvm_ffi", "uvicorn", "uvloop", "xgrammar", "zmq",
)

# Stubbed only for a release that imports them unconditionally (the import fails without them):
# later releases probe sgl_kernel with try/except ImportError and must keep seeing it absent.
LATE_STUBBED_MODULES = ("sgl_kernel", "vllm", "flashinfer", "deep_gemm", "outlines", "interegular", "llguidance", "cuda", "numba")

# Dunder attributes a stub answers (SGLang's transformers patches read them at import);
# every other dunder raises AttributeError, so protocols (pickle, inspect, typing) behave.
_STUB_DUNDERS = {"__func__": None, "__class_validators__": []}


class _Anything:
    """A value that absorbs use: call it, read or set attributes, index it, iterate (empty), test it (False)."""

    __slots__ = ("_path",)

    def __init__(self, path: str = "stub") -> None:
        object.__setattr__(self, "_path", path)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            if name in _STUB_DUNDERS:
                return self
            raise AttributeError(name)
        return _Anything(f"{self._path}.{name}")

    def __setattr__(self, name: str, value: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], _Anything):
            return args[0]  # used as a decorator: keep the function
        return _Anything(f"{self._path}()")

    def __getitem__(self, key: Any) -> Any:
        return _Anything(f"{self._path}[]")

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def __contains__(self, key: Any) -> bool:
        return False

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __bool__(self) -> bool:
        return False

    def __or__(self, other: Any) -> Any:  # `X | None` in annotations evaluated at import
        return self

    __ror__ = __or__

    def __repr__(self) -> str:
        return f"<stub {self._path}>"


class _StubMeta(type):
    """Metaclass of stub classes: class-level reads give stub values; X[...] and X | Y work."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            if name in _STUB_DUNDERS:
                return _STUB_DUNDERS[name] if _STUB_DUNDERS[name] is not None else _Anything(f"{cls.__name__}.{name}")
            raise AttributeError(name)
        return _Anything(f"{cls.__module__}.{cls.__name__}.{name}")

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], type):
            return args[0]  # a stub used as a decorator keeps the function
        return super().__call__(*args, **kwargs)

    def __or__(cls, other: Any) -> Any:
        return cls

    __ror__ = __or__


class _StubClass(metaclass=_StubMeta):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __init_subclass__(cls, **kwargs: Any) -> None:
        pass

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        # a stubbed type named in a pydantic model's fields (vllm's request protocols, built at
        # import): validated as Any, since the type itself never reaches the paths driven
        return handler(Any)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # a decorator factory's result applied to a function
        return _Anything(f"{type(self).__name__}()()")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{type(self).__name__}().{name}")

    # an instance is what a stubbed function returns (`is_flash_attn_available()`): falsy and empty,
    # so feature probes answer "not available"
    def __bool__(self) -> bool:
        return False

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __contains__(self, key: Any) -> bool:
        return False

    def __getitem__(self, key: Any) -> Any:
        return _Anything(f"{type(self).__name__}()[]")


class _ProgressBar(_StubClass):
    """tqdm's progress bar: a loop over `tqdm(xs)` must still run over xs (a capture loop's buckets); every other
    use (update, set_description, close, `with`) is absorbed."""

    def __init__(self, iterable: Any = None, *args: Any, **kwargs: Any) -> None:
        self._iterable = () if iterable is None else iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(self._iterable)

    def __len__(self) -> int:
        return len(self._iterable)

    def __enter__(self) -> "_ProgressBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _trange(*args: Any, **kwargs: Any) -> _ProgressBar:
    return _ProgressBar(range(*args))


# Stub attributes that must behave, per stubbed top-level package: what the engine relies on beyond absorbing use.
_BEHAVING = {"tqdm": {"tqdm": _ProgressBar, "trange": _trange}}


class StubModule(types.ModuleType):
    """A package-like module: every public attribute is a real, subclassable stub class (or a _BEHAVING one)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _BEHAVING.get(self.__name__.split(".")[0], {}).get(name)
        if value is None:
            value = _StubMeta(name, (_StubClass,), {"__module__": self.__name__, "__qualname__": name})
        setattr(self, name, value)
        return value


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves StubModule for the listed top-level names (and their submodules), nothing else."""

    def __init__(self, names: tuple[str, ...] = STUBBED_MODULES) -> None:
        self.names = frozenset(names)
        self.served: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname.split(".")[0] not in self.names:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = StubModule(spec.name)
        mod.__path__ = []  # a package: submodule imports come back here
        mod.__file__ = None
        self.served.add(spec.name.split(".")[0])
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        pass
