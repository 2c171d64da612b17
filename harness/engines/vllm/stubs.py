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

# Installed for real next to the release (pip --no-deps --target): pydantic evaluates vllm.config at import.
REAL_REQUIREMENTS = ("pydantic==2.14.4", "pydantic_core==2.50.5", "annotated_types==0.8.0", "typing_inspection==0.4.5")
# Imported for real from the interpreter or the shared deps dir (harness/engines/install.py).
REAL_MODULES = ("triton", "msgspec", "regex", "pydantic")

# Found by importing the proposer modules of vllm 0.34.0 with nothing but torch, numpy,
# triton and the real modules above.
STUBBED_MODULES = (
    "PIL", "aiohttp", "cachetools", "cbor2", "cloudpickle", "cpuinfo", "einops", "huggingface_hub", "llguidance",
    "prometheus_client", "psutil", "pybase64", "requests", "safetensors", "tqdm", "transformers", "urllib3", "uvloop",
    "xgrammar", "yaml", "zmq",
)
