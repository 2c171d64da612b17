"""Goldens: golden/<case>.npz + golden/<case>.json (in the spirit of pytest-regressions' ndarrays_regression).

What a golden holds, per rank, per iteration, per draft step of the graph runner (the system
under test): the metadata it used (ints, compared exactly), the token ids it produced (exact),
and its float outputs (logits, logprobs, hidden, topk_p: per-key tolerances). Keys are
`r{rank}.i{iteration}.s{step}.{field}`; per rank and iteration also the requests' ids,
prefix and accept lengths (`r{rank}.i{iteration}.{field}`).

The JSON side records the model fingerprint, a hash of the model weights, a hash of the whole
case config (layout, spec, schedule, seed, backend, dtype) and the versions that made it. A
golden whose fingerprints differ from the case's is refused with the differences named, never
compared. Ranks that hold a bitwise-identical array (e.g. the attn-TP ranks of one DP group)
store it once: the JSON maps the other keys to it (`aliases`).

Writes are atomic and crash-consistent: both files go to hidden temporaries first (fsynced),
then the .npz and the .json are os.replace'd in turn. The JSON carries the sha256 of its .npz, so
a crash between the two replaces is detected and rolled forward on the next load (the temporary
JSON is the journal); a crash before them leaves the old golden untouched. Recording is refused
under pytest-xdist: regenerate serially.

The lifecycle in modules: base (directory, format, errors), arrays (what goes in), fingerprint
(what it was made from), store (atomic write, careful load), compare (per key, per tolerance),
lifecycle (check and record).
"""
from harness.golden.arrays import collect, pack_meta, run_for_golden, unpack_meta
from harness.golden.base import (
    DEFAULT_TOLERANCES,
    FORMAT,
    GOLDEN_DIR,
    INT_FIELDS,
    PAUSE_ENV,
    GoldenError,
    GoldenFormatError,
    show,
)
from harness.golden.compare import Comparison, compare, parse_key
from harness.golden.fingerprint import Fingerprint, fingerprint
from harness.golden.lifecycle import RecordResult, check_golden, iter_cases, record_golden, refuse_under_xdist
from harness.golden.store import Golden, load_golden, npz_bytes, write_golden

__all__ = [
    "DEFAULT_TOLERANCES", "FORMAT", "GOLDEN_DIR", "INT_FIELDS", "PAUSE_ENV", "Comparison", "Fingerprint", "Golden", "GoldenError",
    "GoldenFormatError", "RecordResult", "check_golden", "collect", "compare", "fingerprint", "iter_cases", "load_golden", "npz_bytes",
    "pack_meta", "parse_key", "record_golden", "refuse_under_xdist", "run_for_golden", "show", "unpack_meta", "write_golden",
]
