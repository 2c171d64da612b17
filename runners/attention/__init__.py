"""Attention backends behind one interface (torch reference; triton and flashinfer on GPU)."""
from runners.attention.torch_ref import TorchAttnBackend

BACKENDS = {"torch": TorchAttnBackend}


def make_backend(name: str, **kw):
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not available here; known: {sorted(BACKENDS)}")
    return BACKENDS[name](**kw)
