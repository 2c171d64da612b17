"""Triton's interpreter, as the engine adapters run the engines' kernels with it on CPU tensors."""
from __future__ import annotations

import importlib
from typing import Any


def patch_interpreter_index() -> None:
    """Triton's interpreter turns a scalar argument into int() of a 1-element array, which numpy 2
    refuses (a loop bound loaded from memory: `range(0, n, BLOCK)` in vLLM's input-prep kernels and in
    SGLang's rotate_input_ids): take the element instead. Idempotent."""
    interp = importlib.import_module("triton.runtime.interpreter")
    original = interp._patch_lang_tensor

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]) if self.handle.data.size == 1
                       else int(self.handle.data))

    if getattr(original, "__name__", "") != "patch_lang_tensor":
        interp._patch_lang_tensor = patch_lang_tensor
