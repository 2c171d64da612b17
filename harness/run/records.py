"""What P1 reads from a graph runner, taken from outside: one bucket's capture, one replay.

Our runners (harness.run.observe) and an engine's (harness.engines) are observed into the same
two records, so harness.props checks both with one code. Every value keeps the engine's
name from the runner to the report: the host lists are the ForwardBatch's
global_num_tokens_cpu / global_num_tokens_for_logprob_cpu (in `host`), the static tensors
global_num_tokens_gpu / global_num_tokens_for_logprob_gpu.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class CaptureRecord:
    """The capture side of invariant I1: one bucket's host metadata and gathered tensors as baked."""

    bs: int
    num_tokens: int
    host: dict
    global_num_tokens_gpu: Optional[list[int]]
    global_num_tokens_for_logprob_gpu: Optional[list[int]]
    fields: dict[str, "FieldValue"] = field(default_factory=dict)  # every field of the batch (and its spec info) as built


@dataclass(frozen=True)
class ReplayRecord:
    """One replay: its bucket's capture record, the static buffers after the replay fill, and what
    the graph fed lm_head (None when no graph ran: the metadata-only path)."""

    runner: str  # a runners.base_cuda_graph_runner.RunnerKind for ours; an engine's runner name for theirs
    step: int
    branch: str
    raw_bs: int
    bs: int
    tokens_per_bs: int
    capture: CaptureRecord
    global_num_tokens_gpu: Optional[list[int]]
    global_num_tokens_for_logprob_gpu: Optional[list[int]]
    gpu_shape: Optional[tuple[int, ...]]
    padded_seq_lens: list[int]
    seq_lens_sum: int
    seq_lens_sum_actual: int
    rows_fed: Optional[int] = None
    logits_rows: Optional[int] = None
    captured_bs: list[int] = field(default_factory=list)
    host_mirror_stale_lanes: Optional[list[int]] = None  # lanes whose host seq_lens / tree mask differ from the device's (None: no mirror)
    fields: dict[str, "FieldValue"] = field(default_factory=dict)  # what the replay writes for this bucket (empty: not observed)


def tensor_values(t: Optional[torch.Tensor]) -> Optional[list[int]]:
    """A small static int tensor read back to the host (a device sync: an engine never does this)."""
    if t is None:
        return None
    values = t.tolist()
    return values if t.dim() == 1 and t.dtype in _INT_DTYPES else [int(x) for x in values]  # a 1-D integer tensor's are ints already


_INT_DTYPES = frozenset((torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8))


# A tensor this small has its values kept in its FieldValue (a bucket-determined tensor, the gathered counts, is
# compared by value); a larger one by dtype, shape and which buffer it views. Reading values back is a device sync.
SMALL_TENSOR = 16


@dataclass(frozen=True)
class FieldValue:
    """One field of a forward batch, a spec info or a replay's view of them, as invariant I1 compares it
    (harness.props.p1_fields): a tensor by dtype, shape and the buffer it views (`storage`: which memory, at which
    offset: a tensor the capture built for itself is not the one the replay writes), a host value by value.
    `default`: the field holds its dataclass's declared default (what a capture that never set it leaves)."""

    kind: str  # "tensor", "host", "none" (None), "object" (anything else: compared by type)
    dtype: Optional[str] = None
    shape: Optional[tuple[int, ...]] = None
    value: Any = None  # host: the value (lists as tuples, enums by name); a tensor: None
    # tensor: (its storage's address, its offset in elements): which memory in this process, so not part of the value
    storage: Optional[tuple[int, int]] = field(default=None, compare=False)
    default: bool = False
    # a small tensor's values when read (what a bucket-determined tensor is compared by); not part of the field's
    # value either: a batch-determined tensor holds another batch's values each time it is read
    sample: Optional[tuple] = field(default=None, compare=False)

    @property
    def is_set(self) -> bool:
        return self.kind != "none"

    def describe(self) -> str:
        if self.kind == "tensor":
            vals = "" if self.sample is None else f" = {list(self.sample)}"
            return f"tensor {self.dtype} {list(self.shape or ())}{vals}"
        if self.kind == "none":
            return "None" + (" (its default)" if self.default else "")
        if self.kind == "object":
            return f"a {self.value}" + (" (its default)" if self.default else "")
        return repr(self.value) + (" (its default)" if self.default else "")


def field_value(x: Any, default: Any = dataclasses.MISSING) -> FieldValue:
    """x as I1 compares it; `default` is the field's declared default, when it has one."""
    is_default = default is not dataclasses.MISSING and _same(x, default)
    if x is None:
        return FieldValue("none", default=is_default)
    if isinstance(x, torch.Tensor):
        meta = x.is_meta
        sample = None
        if x.numel() <= SMALL_TENSOR and not meta:
            sample = tuple((x if x.dim() == 1 else x.reshape(-1)).tolist())
        storage = None if meta else (x.untyped_storage().data_ptr(), int(x.storage_offset()))
        return FieldValue("tensor", _dtype_name(x.dtype), tuple(x.shape), None, storage, is_default, sample)
    if isinstance(x, enum.Enum):
        return FieldValue("host", value=x.name.lower(), default=is_default)
    if isinstance(x, _HOST_SCALARS):
        return FieldValue("host", value=x, default=is_default)
    if isinstance(x, (list, tuple)) and _host_scalars(x):
        return FieldValue("host", value=tuple(x), default=is_default)
    return FieldValue("object", value=type(x).__name__, default=is_default)


_HOST_SCALARS = (bool, int, float, str)
_HOST_SCALAR_TYPES = frozenset(_HOST_SCALARS)


def _host_scalars(seq: list | tuple) -> bool:
    """Every element a host scalar; the exact types first (a host list is ints), isinstance for their subclasses."""
    return set(map(type, seq)) <= _HOST_SCALAR_TYPES or all(isinstance(e, _HOST_SCALARS) for e in seq)


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _same(x: Any, default: Any) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(default, torch.Tensor):
        return x is default
    try:
        return bool(x == default)
    except Exception:  # an object whose == is not a truth value (an array): not the default
        return False


def batch_fields(batch: Any, nested: tuple[str, ...] = ("spec_info",)) -> dict[str, FieldValue]:
    """Every public field of a forward batch (a dataclass: its declared fields with their defaults; anything else, a
    replay's namespace view: its attributes), and those of its `nested` members (the spec info) as 'spec_info.NAME'.
    Introspected, so a field added to the batch is compared without anyone listing it."""
    out: dict[str, FieldValue] = {}
    for name, value, default in _members(batch):
        if name in nested and value is not None:
            out.update({f"{name}.{k}": v for k, v in batch_fields(value, ()).items()})
            out[name] = FieldValue("object", value=type(value).__name__)
        else:
            out[name] = field_value(value, default)
    return out


def _members(obj: Any) -> list[tuple[str, Any, Any]]:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        declared = _declared(type(obj))
        out = [(name, getattr(obj, name), default if factory is dataclasses.MISSING else factory())
               for name, default, factory in declared if not name.startswith("_")]
        names = {name for name, _, _ in declared}
        # attributes set past the declared fields too
        out += [(k, v, dataclasses.MISSING) for k, v in getattr(obj, "__dict__", {}).items() if k not in names and not k.startswith("_")]
        return out
    return [(k, v, dataclasses.MISSING) for k, v in getattr(obj, "__dict__", {}).items() if not k.startswith("_") and not callable(v)]


@functools.lru_cache(maxsize=None)
def _declared(cls: type) -> tuple[tuple[str, Any, Any], ...]:
    """A dataclass's declared fields as (name, default, default_factory), MISSING where it has none: what depends on the
    class alone, read once per class. The factory is still called per record (what it returns is not ours to share)."""
    return tuple((f.name, f.default, f.default_factory) for f in dataclasses.fields(cls))


def device_independent(rec: ReplayRecord) -> ReplayRecord:
    """rec as two devices' runs of one case must agree on it: without the tensor fields its replay was seen to write.
    A fill's writes are seen through the buffers' version counters, which a fill by a kernel (the CUDA fused fill)
    does not move, so which tensors show depends on the device; the counts, the host fields and the capture's fields
    (compared by dtype and shape, never by memory) are the same on either."""
    return dataclasses.replace(rec, fields={k: f for k, f in rec.fields.items() if f.kind != "tensor"})
