"""Request-to-token map and the paged (page size 1) KV pool of one rank.

Slot 0 is the padding slot: padded lanes of a CUDA graph write their KV there, so it is
never handed to a request.
"""
from __future__ import annotations

import torch

PADDING_SLOT = 0


class ReqToTokenPool:
    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device):
        self.req_to_token = torch.zeros(max_reqs, max_context_len, dtype=torch.int64, device=device)
        self.free = list(range(1, max_reqs))  # index 0 stays a harmless default for padded lanes

    def alloc(self) -> int:
        if not self.free:
            raise RuntimeError("request pool exhausted")
        return self.free.pop(0)

    def release(self, idx: int) -> None:
        self.free.append(idx)


class TokenToKVPool:
    """One K and one V tensor per layer: [num_slots, local_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (num_slots, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.free = list(range(PADDING_SLOT + 1, num_slots))

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"KV pool exhausted: need {n} slots, {len(self.free)} free")
        out, self.free = self.free[:n], self.free[n:]
        return out

    def release(self, slots: list[int]) -> None:
        self.free.extend(slots)

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, loc, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(0, loc, v.to(self.v[layer].dtype))
