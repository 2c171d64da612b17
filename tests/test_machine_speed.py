"""benchmarks/machine_speed.py, the yardstick .ci/run prints beside its phases: its workloads compute what they must
(every key of the dict read once, the copy whole), and its figures come from a clock, never from the work's result.
A fake clock makes the figures exact (no timed assertion)."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from benchmarks import machine_speed


def test_the_scattered_reads_visit_every_key_once(monkeypatch):
    assert math.gcd(machine_speed.STRIDE, machine_speed.PYTHON_ITEMS) == 1  # the stride walks all of the shipped size
    monkeypatch.setattr(machine_speed, "PYTHON_ITEMS", 1000)
    assert machine_speed.python_round() == sum(range(1000))


def test_the_copy_round_copies_the_whole_buffer():
    src, dst = bytearray(b"\x07") * 1024, bytearray(1024)
    machine_speed.copy_round(src, dst)
    assert dst == src


def test_figures_are_medians_of_the_clock(monkeypatch, capsys):
    """Rounds of 1, 5 and 3 ms: the median, 3 ms, whatever the order; the copy figure is bytes read and written over it."""
    ticks = iter([0, 0.001, 0.010, 0.015, 0.020, 0.023] * 2)
    monkeypatch.setattr(machine_speed, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))  # its clock alone
    monkeypatch.setattr(machine_speed, "python_round", lambda: None)
    monkeypatch.setattr(machine_speed, "copy_round", lambda src, dst: None)
    monkeypatch.setattr(machine_speed, "COPY_BYTES", 3_000_000)
    monkeypatch.setattr(machine_speed, "COPIES", 8)
    assert machine_speed.main(["--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == {"python_s": 0.003, "copy_gb_s": 16.0}  # 3 MB read and 3 MB written, 8 times, in 3 ms


def test_rounds_below_one_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        machine_speed.main(["--rounds", "0"])
    assert exit_.value.code == 2 and "--rounds must be at least 1 (got 0)" in capsys.readouterr().err
