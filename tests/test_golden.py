"""Goldens (golden/<case>.npz + .json): every shipped case matches its golden; record is atomic
(a SIGKILL mid-write leaves the old golden intact), deterministic, refused under pytest-xdist;
a golden of other weights or config is refused, never compared; mismatches are reported with
% differing, max abs/rel error and the first indices, by rank and step.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from harness import golden as G
from harness.cases.case import default_cases, load_case
from harness.cli import main
from harness.golden.base import GoldenKind
from harness.golden.case_goldens import missing_kinds, needed_kinds
from tests.helpers.prewarmed import start_module

SHIPPED = default_cases()
TINY = """name = "{name}"
description = "a tiny case for golden mechanics"
seed = {seed}

[layout]
tp_size = 2

[spec]
num_steps = 2
capture_bs = [2]
max_running_requests = 2

[schedule]
batches = [[1], [2]]
"""


def tiny(tmp_path: Path, seed: int = 0, name: str = "tiny") -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(TINY.format(name=name, seed=seed))
    return path


# ----------------------------------------------------------------------------------------
# the regression itself: every shipped case against its golden
# ----------------------------------------------------------------------------------------


# Every shipped case against its golden: harness.plugin's golden item per case (tests/conftest.py enables the plugin).


def test_every_shipped_case_has_every_golden_its_checks_read():
    """What `harness new-case --record` and `harness golden record CASE` leave behind, so the suite's per-case tests
    (this file's, P6's in test_spec_decode.py, the draft-tree probe's) find a golden for each case."""
    missing = {c.name: [str(k) for k in missing_kinds(c)] for c in SHIPPED if missing_kinds(c)}
    assert not missing, f"record them: harness golden record <case> ({missing})"
    kinds = {c.name: needed_kinds(c) for c in SHIPPED}
    assert kinds["tp1_neither"] == (GoldenKind.ARRAYS, GoldenKind.ACCEPTANCE)  # the loop runs every multi-layer TP case
    assert kinds["tp2_single_layer_shrink"] == (GoldenKind.ARRAYS, GoldenKind.ACCEPTANCE, GoldenKind.DRAFT_TREE)


def test_every_golden_belongs_to_a_case():
    names = {c.name for c in SHIPPED}
    stray = sorted(p.stem for p in G.GOLDEN_DIR.glob("*.npz") if p.stem not in names)
    assert not stray, f"goldens without a case: {stray}"


# ----------------------------------------------------------------------------------------
# record: deterministic, unchanged stays unwritten, what changed is shown
# ----------------------------------------------------------------------------------------


def test_record_is_deterministic_and_unchanged_is_not_rewritten(tmp_path):
    case = load_case(tiny(tmp_path))
    d = tmp_path / "golden"
    res = G.record_golden(case, d)
    assert res.status == "new" and (d / "tiny.npz").exists() and (d / "tiny.json").exists()
    before = (d / "tiny.npz").read_bytes(), (d / "tiny.json").read_bytes()
    mtime = (d / "tiny.npz").stat().st_mtime_ns
    again = G.record_golden(case, d)
    assert again.status == "unchanged" and "not rewritten" in again.format()
    assert ((d / "tiny.npz").read_bytes(), (d / "tiny.json").read_bytes()) == before and (d / "tiny.npz").stat().st_mtime_ns == mtime
    assert G.check_golden(case, d).ok
    assert G.npz_bytes({"a": np.arange(3)}) == G.npz_bytes({"a": np.arange(3)})  # fixed zip timestamps


def test_golden_contents_exact_ints_and_float_tolerances(tmp_path):
    case = load_case(tiny(tmp_path))
    d = tmp_path / "golden"
    G.record_golden(case, d)
    g = G.load_golden(d, "tiny")
    arrays = g.resolved()
    assert set(G.parse_key(k)[3] for k in arrays) == {"requests", "meta", *G.INT_FIELDS, *G.DEFAULT_TOLERANCES}
    meta = G.unpack_meta(arrays["r1.i0.s1.meta"])
    assert meta["raw_bs"] == [1] and meta["bs"] == [2] and meta["rows_fed"] == [6] and meta["graph_replayed"] == [1]
    assert meta["global_num_tokens_for_logprob_cpu"] is None  # plain TP: no gathered buffer
    assert arrays["r0.i1.requests"].shape == (2, 3) and arrays["r0.i1.s0.logits"].shape == (6, 512)
    assert g.meta["aliases"]["r1.i0.s0.logits"] == "r0.i0.s0.logits"  # rank 1's identical logits are stored once
    m = g.meta
    assert m["format"] == G.FORMAT and m["versions"]["torch"] and m["model_fingerprint"] == case.scenario.model.fingerprint()
    assert m["tolerances"]["logits"]["rtol"] == 1e-5 and m["config"]["layout"]["tp_size"] == 2


def test_mismatch_report_names_rank_step_percent_and_errors(tmp_path):
    case = load_case(tiny(tmp_path))
    d = tmp_path / "golden"
    G.record_golden(case, d)
    g = G.load_golden(d, "tiny")
    arrays = g.resolved()
    arrays["r1.i1.s0.logits"] = arrays["r1.i1.s0.logits"].copy()
    arrays["r1.i1.s0.logits"][3, 7:9] += 0.5  # 2 of 6*512 values off by 0.5
    arrays["r1.i1.s0.logits"][0, 0] += 5e-6  # within tolerance: not reported
    meta = G.unpack_meta(arrays["r0.i0.s1.meta"])
    meta["rows_fed"] = [1]
    arrays["r0.i0.s1.meta"] = G.pack_meta(meta)
    G.write_golden(d, "tiny", arrays, {k: v for k, v in g.meta.items() if k not in ("aliases", "npz_sha256")})
    cmp = G.check_golden(case, d)
    assert not cmp.ok and len(cmp.diffs) == 2
    by_key = {x.key: x for x in cmp.diffs}
    lg = by_key["r1.i1.s0.logits"]
    assert (lg.n_diff, lg.n_total, lg.first) == (2, 3072, [(3, 7), (3, 8)])
    assert lg.max_abs == pytest.approx(0.5, rel=1e-5)
    mt = by_key["r0.i0.s1.meta.rows_fed"]
    assert (mt.expected, mt.got) == ([1], [6])  # the bucket (2) times 3 tokens
    text = cmp.format()
    want, got = float(arrays["r1.i1.s0.logits"][3, 7]), float(arrays["r1.i1.s0.logits"][3, 7]) - 0.5  # the golden as written, the run as it was
    assert "2 of" in text and "2/3072 (0.0651%)" in text and "5.00e-01" in text
    assert f"at (3, 7) expected {want:.6g}, got {got:.6g}; at (3, 8) expected" in text  # the values, not just where
    assert "expected [1], got [6]" in text
    row = next(ln for ln in text.splitlines() if "logits" in ln).split()
    assert row[:3] == ["1", "1", "0"]  # rank, iteration, step
    assert json.loads(json.dumps(cmp.to_json()))["diffs"][0]["percent"] is not None


def test_case_tolerance_overrides_the_default(tmp_path):
    path = tiny(tmp_path)
    case = load_case(path)
    d = tmp_path / "golden"
    G.record_golden(case, d)
    g = G.load_golden(d, "tiny")
    arrays = g.resolved()
    arrays["r0.i0.s0.hidden"] = arrays["r0.i0.s0.hidden"] + 1e-3
    G.write_golden(d, "tiny", arrays, {k: v for k, v in g.meta.items() if k not in ("aliases", "npz_sha256")})
    assert not G.check_golden(case, d).ok
    path.write_text(path.read_text() + '\n[tolerances.golden]\nhidden = { rtol = 0.0, atol = 2e-3, reason = "test" }\n')
    assert G.check_golden(load_case(path), d).ok


def test_record_shows_what_changed(tmp_path):
    d = tmp_path / "golden"
    G.record_golden(load_case(tiny(tmp_path)), d)
    res = G.record_golden(load_case(tiny(tmp_path, seed=1)), d)
    text = res.format()
    assert res.status == "config-changed" and "seed 0 -> 1" in text and "what changed" in text and "logits" in text
    assert G.check_golden(load_case(tiny(tmp_path, seed=1)), d).ok


# ----------------------------------------------------------------------------------------
# refusals: other weights or config, xdist, inconsistent pairs, missing goldens
# ----------------------------------------------------------------------------------------


def test_golden_of_another_config_is_refused_not_compared(tmp_path):
    d = tmp_path / "golden"
    G.record_golden(load_case(tiny(tmp_path)), d)
    path = tiny(tmp_path)
    path.write_text(path.read_text() + "\n[model]\nseed = 3\n")
    with pytest.raises(G.GoldenError) as e:
        G.check_golden(load_case(path), d)
    msg = str(e.value)
    assert "refused" in msg and "model config fingerprint" in msg and "model.seed 0 -> 3" in msg and "Not compared" in msg
    assert "harness golden record tiny" in msg and "\n" not in msg


def test_golden_of_other_weights_is_refused(tmp_path, monkeypatch):
    case = load_case(tiny(tmp_path))
    d = tmp_path / "golden"
    G.record_golden(case, d)
    from runners import model

    real = model.full_weight
    monkeypatch.setattr(model, "full_weight", lambda cfg, name, shape: real(cfg, name, shape) * 1.001)  # new init code, same config
    with pytest.raises(G.GoldenError, match="model weights hash"):
        G.check_golden(case, d)


def test_record_refused_under_xdist(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    with pytest.raises(G.GoldenError, match="pytest-xdist.*gw3.*serially"):
        G.record_golden(load_case(tiny(tmp_path)), G.GOLDEN_DIR)  # refused before anything runs or is written
    assert main(["golden", "record", "--all"]) == 2
    assert "refusing to record goldens under pytest-xdist" in capsys.readouterr().err
    assert not (G.GOLDEN_DIR / "tiny.npz").exists()
    assert G.record_golden(load_case(tiny(tmp_path)), tmp_path / "golden").status == "new"  # a private dir can't race


def test_inconsistent_pair_is_detected(tmp_path):
    d = tmp_path / "golden"
    G.record_golden(load_case(tiny(tmp_path)), d)
    G.record_golden(load_case(tiny(tmp_path, seed=1, name="other")), d)
    (d / "tiny.npz").write_bytes((d / "other.npz").read_bytes())
    with pytest.raises(G.GoldenError, match="does not match"):
        G.load_golden(d, "tiny")


def test_golden_check_cli_missing_and_passing(tmp_path, capsys):
    path = tiny(tmp_path)
    d = tmp_path / "golden"
    assert main(["golden", "check", str(path), "--golden-dir", str(d)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "no golden" in out and "harness golden record tiny" in out
    assert main(["golden", "record", str(path), "--golden-dir", str(d)]) == 0
    assert "new golden" in capsys.readouterr().out
    assert main(["golden", "check", str(path), "--golden-dir", str(d), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["cases"][0]["keys"] > 0
    assert main(["golden", "record", "--golden-dir", str(d)]) == 2  # neither cases nor --all
    assert "--all" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------
# atomicity: SIGKILL mid-write
# ----------------------------------------------------------------------------------------


def _record_and_kill(path: Path, d: Path, point: str) -> None:
    """`harness golden record` in a process of its own (forked from the prewarmed server), SIGKILLed where it pauses."""
    env = dict(os.environ, **{G.PAUSE_ENV: f"{point}:60"})
    env.pop("PYTEST_XDIST_WORKER", None)  # a private golden dir: no race with other workers
    p = start_module("harness.cli", "golden", "record", str(path), "--golden-dir", str(d), env=env)
    try:
        deadline = time.monotonic() + 120
        while f"golden: paused at {point}" not in p.stderr_so_far():
            if p.wait(0.05) is not None:
                pytest.fail(f"record exited (rc {p.wait(0)}) before pausing at {point}: {p.stderr_so_far()[-2000:]}")
            assert time.monotonic() < deadline, "record never reached the pause point"
        os.kill(p.pid, signal.SIGKILL)
    finally:
        if p.wait(0) is None:
            os.kill(p.pid, signal.SIGKILL)
        rc = p.result(30).returncode
    assert rc == -signal.SIGKILL


def test_sigkill_after_the_temporaries_leaves_the_old_golden_intact(tmp_path):
    d = tmp_path / "golden"
    old_case = load_case(tiny(tmp_path))
    G.record_golden(old_case, d)
    old = (d / "tiny.npz").read_bytes(), (d / "tiny.json").read_bytes()
    path = tiny(tmp_path, seed=1)  # a record that would change the golden
    _record_and_kill(path, d, "written")
    assert ((d / "tiny.npz").read_bytes(), (d / "tiny.json").read_bytes()) == old
    assert (d / ".tiny.npz.tmp").exists() and (d / ".tiny.json.tmp").exists()  # what the killed writer left
    assert G.check_golden(old_case, d).ok  # loads the old pair and clears the temporaries
    assert not (d / ".tiny.npz.tmp").exists() and not (d / ".tiny.json.tmp").exists()


def test_sigkill_between_the_two_replaces_rolls_forward_to_a_consistent_pair(tmp_path):
    d = tmp_path / "golden"
    G.record_golden(load_case(tiny(tmp_path)), d)
    path = tiny(tmp_path, seed=1)
    _record_and_kill(path, d, "between")
    assert (d / ".tiny.json.tmp").exists() and not (d / ".tiny.npz.tmp").exists()  # new npz in place, its json not yet
    g = G.load_golden(d, "tiny")  # the journal (temporary json) matches the new npz: finish the record
    assert g.meta["config"]["seed"] == 1 and not (d / ".tiny.json.tmp").exists()
    assert G.check_golden(load_case(path), d).ok
