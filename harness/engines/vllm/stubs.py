"""Import stubs and the few real imports vLLM's EAGLE proposer modules need on a CPU-only torch.

The proposer modules (vllm/v1/worker/gpu/spec_decode/..., cudagraph_utils, dp_utils) pull in
vllm.config, whose configs are pydantic dataclasses evaluated at import: pydantic is
installed for real (REAL_REQUIREMENTS, into the vLLM deps dir). Everything else below is
third-party code those modules import but the host-side paths we drive (capture-size
tables, dispatch, the DP agreement, the input-prep kernels) never call: served by the same
meta-path finder as SGLang's stubs, with vLLM's own list. A release that imports a new one
fails with ModuleNotFoundError naming it: add it here.
"""
from __future__ import annotations

import importlib.abc
import importlib.metadata
from pathlib import Path
from typing import Any, Optional

# Installed for real next to the release (pip --no-deps --target): pydantic evaluates vllm.config at import.
REAL_REQUIREMENTS = ("pydantic==2.14.4", "pydantic_core==2.50.5", "annotated_types==0.8.0", "typing_inspection==0.4.5")
# Imported for real from the interpreter or the shared deps dir (harness/engines/install.py).
REAL_MODULES = ("triton", "msgspec", "regex", "pydantic")

# Found by importing the proposer modules of every vllm release from 0.11 to 0.34 with nothing but torch, numpy,
# triton and the real modules above.
STUBBED_MODULES = (
    "aiohttp", "blake3", "cachetools", "cbor2", "cloudpickle", "cpuinfo", "diskcache", "einops", "fastapi", "gguf",
    "huggingface_hub", "llguidance", "mistral_common", "openai", "openai_harmony", "partial_json_parser", "PIL",
    "prometheus_client", "psutil", "pybase64", "requests", "safetensors", "setproctitle", "tqdm", "transformers",
    "urllib3", "uvloop", "xgrammar", "yaml", "zmq",
)

# Stubbed packages whose installed version a release reads at import (importlib.metadata.version):
# up to 0.31, vllm.transformers_utils.config refuses a transformers below 5. The stub answers as
# the oldest version the release accepts.
STUB_VERSIONS = {"transformers": "5.0.0"}


class _StubDistribution(importlib.metadata.Distribution):
    def __init__(self, name: str, version: str) -> None:
        self._metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"

    def read_text(self, filename: str) -> Optional[str]:
        return self._metadata if filename == "METADATA" else None

    def locate_file(self, path: Any) -> Path:
        return Path(str(path))


class StubDistributionFinder(importlib.abc.MetaPathFinder):
    """Package metadata for the stubbed packages of STUB_VERSIONS (imports are the StubFinder's)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        return None

    def find_distributions(self, context: Any = None) -> list[importlib.metadata.Distribution]:
        name = (getattr(context, "name", None) or "").lower().replace("-", "_")
        return [_StubDistribution(name, STUB_VERSIONS[name])] if name in STUB_VERSIONS else []
