"""Collective signatures: a small int64 vector every member of a group exchanges before a
collective, so that members calling different collectives fail at once, each naming the odd
rank out, instead of hanging or exchanging garbage.
"""
from __future__ import annotations

import zlib
from collections import Counter
from typing import Optional, Sequence

import torch

from harness.ranks.trace import CollectiveCall
from runners.parallel.comm import Group

GROUP_ORDER: tuple[Group, ...] = (Group.WORLD, Group.ATTN_TP, Group.ATTN_DP)
OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_gather_v", "broadcast", "barrier")

MAX_DIMS = 8
MAX_EXTRA = 8
_MAGIC = 0x5EC
_GROUP_IDS = {g.value: i for i, g in enumerate(GROUP_ORDER)}
_OP_IDS = {op: i + 1 for i, op in enumerate(OPS)}
_DTYPES: list[torch.dtype] = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
] + [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                  "uint16", "uint32", "uint64") if hasattr(torch, n)]  # fmt: skip
_DTYPE_IDS = {str(d): i + 1 for i, d in enumerate(_DTYPES)}
_DTYPE_NAMES = {i: name for name, i in _DTYPE_IDS.items()}
# [magic, op, group, ndim, dtype, n_extra, extra*MAX_EXTRA, dims*MAX_DIMS, shape_crc] are compared;
# [seq, dim0] are information only (all_gather_v compares trailing dims only; seq may differ).
_N_CMP = 6 + MAX_EXTRA + MAX_DIMS + 1
SIGNATURE_LEN = _N_CMP + 2


def _crc(values: Sequence[int]) -> int:
    return zlib.crc32(repr(tuple(int(v) for v in values)).encode())


def _dtype_id(dtype: str) -> int:
    if not dtype:
        return 0
    return _DTYPE_IDS.get(dtype, 10_000 + _crc([zlib.crc32(dtype.encode())]) % 1_000_000)


def encode_signature(call: CollectiveCall, extra: Sequence[int] = ()) -> list[int]:
    """The signature of `call`: equal on two members iff they may take part in the same collective.

    extra: all_gather_v's lengths, broadcast's [src]. all_gather_v compares only the
    trailing dims (each member may hold a differently padded buffer).
    """
    shape = list(call.shape)
    cmp_shape = [-1] + shape[1:] if call.op == "all_gather_v" and shape else shape
    extra = [int(e) for e in extra]
    ex = extra[:MAX_EXTRA] + [-1] * (MAX_EXTRA - min(len(extra), MAX_EXTRA))
    dims = cmp_shape[:MAX_DIMS] + [-1] * (MAX_DIMS - min(len(cmp_shape), MAX_DIMS))
    sig = [_MAGIC, _OP_IDS[call.op], _GROUP_IDS[call.group], len(shape), _dtype_id(call.dtype), len(extra)]
    sig += ex + dims + [_crc(cmp_shape + [-7] + extra)]
    sig += [call.seq, shape[0] if shape else -1]
    assert len(sig) == SIGNATURE_LEN
    return sig


def describe_signature(sig: Sequence[int]) -> str:
    """Inverse of encode_signature, as CollectiveCall.describe() prints (plus lengths / src)."""
    sig = [int(v) for v in sig]
    if len(sig) != SIGNATURE_LEN or sig[0] != _MAGIC:
        return f"<corrupt collective signature {sig}>"
    op = OPS[sig[1] - 1] if 1 <= sig[1] <= len(OPS) else f"op#{sig[1]}"
    group = GROUP_ORDER[sig[2]].value if 0 <= sig[2] < len(GROUP_ORDER) else f"group#{sig[2]}"
    ndim, n_extra = sig[3], sig[5]
    extra = sig[6 : 6 + min(n_extra, MAX_EXTRA)]
    dims = sig[6 + MAX_EXTRA : 6 + MAX_EXTRA + MAX_DIMS]
    seq, dim0 = sig[-2], sig[-1]
    if ndim <= MAX_DIMS:
        shape = dims[:ndim]
        if ndim and op == "all_gather_v":
            shape[0] = dim0
        shape_s = str(tuple(shape))
    else:
        shape_s = f"<{ndim} dims>"
    dtype = _DTYPE_NAMES.get(sig[4], "" if sig[4] == 0 else f"dtype#{sig[4]}")
    s = CollectiveCall(seq, op, group, (), (), dtype).describe().replace("shape=()", f"shape={shape_s}")
    if op == "all_gather_v":
        s = s[:-1] + f", lengths={list(extra)}" + ("..." if n_extra > MAX_EXTRA else "") + ")"
    elif op == "broadcast" and extra:
        s = s[:-1] + f", src={extra[0]})"
    return s


def mismatch_message(sigs: Sequence[Sequence[int]], group_ranks: Sequence[int], group: str = "") -> Optional[str]:
    """None if every member's signature agrees, else a message naming the odd rank(s) out.

    The reference is the signature most members share (ties: the lowest group rank), so
    the message names the rank(s) that differ: ``rank 3 called all_gather(...) where rank 2
    called reduce_scatter(...)``. Every member computes the same message.
    """
    keys = [tuple(int(v) for v in s[:_N_CMP]) for s in sigs]
    if len(set(keys)) == 1:
        return None
    counts = Counter(keys)
    ref = max(range(len(keys)), key=lambda i: (counts[keys[i]], -i))
    odd = [i for i in range(len(keys)) if keys[i] != keys[ref]]
    parts = [
        f"rank {group_ranks[i]} called {describe_signature(sigs[i])} [its collective #{int(sigs[i][-2])}]" for i in odd
    ]
    return (
        f"collective mismatch in group {group or '?'} (ranks {tuple(group_ranks)}): "
        f"{'; '.join(parts)} where rank {group_ranks[ref]} called "
        f"{describe_signature(sigs[ref])} [its collective #{int(sigs[ref][-2])}]"
    )
