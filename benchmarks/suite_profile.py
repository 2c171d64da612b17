"""Where the test suite's time goes: wall and CPU seconds per test, per file and per xdist worker.

A pytest plugin and its report. Loaded with `-p benchmarks.suite_profile`, each test's phases (setup, call, teardown)
are timed on the wall clock and on the CPU of every process the test used: the worker itself, the processes it waited
for (subprocesses, torchrun, ranks) and the worker's forkserver with its children (the prewarmed engine checks and
gloo ranks fork from it, and it reaps them). One JSON line per test goes to $SPECHARNESS_PROFILE_DIR/<worker>.jsonl.

    SPECHARNESS_PROFILE_DIR=out/profile pytest -n auto      (conftest.py loads the plugin when the folder is set;
    python -m pytest -p benchmarks.suite_profile ...         loads it by name, the repo root being on sys.path)
    python benchmarks/suite_profile.py out/profile [--top 40] [--compare out/profile-before]

The report: CPU and wall per test file, the busiest worker's wall (the xdist critical path), the longest tests;
with --compare, each file's CPU beside another run's. harness.plugin's case items (tests/conftest.py enables the
plugin) count as one "file", tests::specharness.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing.forkserver
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

ENV = "SPECHARNESS_PROFILE_DIR"
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_of(pid: int | str) -> float:
    """utime + stime + cutime + cstime of a process (its own CPU and that of the children it reaped), in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return sum(int(f) for f in fields[11:15]) / _TICK  # fields 14-17 of proc(5), counted after the ")"


def _cpu() -> float:
    server = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    return _cpu_of("self") + (_cpu_of(server) if server else 0.0)


class _Recorder:
    def __init__(self, out: Path) -> None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        out.mkdir(parents=True, exist_ok=True)
        self._file = (out / f"{worker}.jsonl").open("a")
        self._worker = worker
        self._phases: dict[str, dict[str, list[float]]] = {}
        self._start: dict[str, float] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        t0, c0 = time.time(), _cpu()
        yield
        t1, c1 = time.time(), _cpu()
        phases = self._phases.pop(item.nodeid, {})
        self._file.write(json.dumps({"nodeid": item.nodeid, "worker": self._worker, "start": t0, "wall": t1 - t0, "cpu": c1 - c0,
                                     "phases": phases}) + "\n")
        self._file.flush()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        yield from self._phase(item, "setup")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        yield from self._phase(item, "call")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        yield from self._phase(item, "teardown")

    def pytest_sessionfinish(self) -> None:
        """The process's whole CPU (start-up, collection and the tests, with its children and its forkserver's), so the
        report can say what the tests' own rows leave out."""
        self._file.write(json.dumps({"session": True, "worker": self._worker, "cpu": _cpu()}) + "\n")
        self._file.flush()

    def _phase(self, item: pytest.Item, name: str):
        t0, c0 = time.time(), _cpu()
        yield
        self._phases.setdefault(item.nodeid, {})[name] = [round(time.time() - t0, 3), round(_cpu() - c0, 3)]


def pytest_configure(config: pytest.Config) -> None:
    out = os.environ.get(ENV)
    if out:
        # xdist's controller runs no test (and its CPU, once it reaps them, holds its workers'): the workers record
        if getattr(config.option, "dist", "no") == "no" or os.environ.get("PYTEST_XDIST_WORKER"):
            config.pluginmanager.register(_Recorder(Path(out)), "suite-profile-recorder")


def _records(folder: Path) -> list[dict]:
    records = [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.read_text().splitlines() if line]
    if not records:
        raise SystemExit(f"{folder}: no *.jsonl (run pytest with {ENV}={folder})")
    return records


def _rows(folder: Path) -> list[dict]:
    return [r for r in _records(folder) if not r.get("session")]


def _file(nodeid: str) -> str:
    """A test's file; the plugin's case items (tests::specharness::<case>::<property>) as one."""
    parts = nodeid.split("::")
    return "::".join(parts[:2]) if len(parts) > 1 and parts[1] == "specharness" else parts[0]


def _per_file(rows: list[dict]) -> dict[str, list[float]]:
    per_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        acc = per_file[_file(r["nodeid"])]
        acc[0] += r["cpu"]
        acc[1] += r["wall"]
        acc[2] += 1
    return per_file


def report(folder: Path, top: int, compare: Path | None = None) -> None:
    rows = _rows(folder)
    per_file = _per_file(rows)
    per_worker: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        acc = per_worker[r["worker"]]
        acc[0] += r["cpu"]
        acc[1] += r["wall"]
        acc[2] += 1
    whole = {r["worker"]: r["cpu"] for r in _records(folder) if r.get("session")}  # absent where a run was cut short
    cpu, wall = sum(r["cpu"] for r in rows), sum(r["wall"] for r in rows)
    span = max(r["start"] + r["wall"] for r in rows) - min(r["start"] for r in rows)
    print(f"{len(rows)} tests; CPU {cpu:.0f} s in the tests" + (f", {sum(whole.values()):.0f} s in the workers' processes "
          "(start-up and collection too)" if whole else "") + f"; wall summed over workers {wall:.0f} s; first start to last end {span:.0f} s")
    print("\nper worker (the largest wall is the critical path):")
    for w, (c, wl, n) in sorted(per_worker.items()):
        print(f"  {w:8s} wall {wl:7.1f} s  CPU {c:7.1f} s  {n:5d} tests" + (f"  (whole process {whole[w]:.1f} s)" if w in whole else ""))
    before = _per_file(_rows(compare)) if compare else {}
    head = f"  {'CPU':>7s} {'wall':>7s} {'tests':>5s}" + (f" {'CPU was':>7s} {'tests':>5s}" if compare else "") + "  file"
    print(f"\nper file, by CPU (s){f'; was: {compare}' if compare else ''}:\n{head}")
    for f, (c, wl, n) in sorted(per_file.items(), key=lambda kv: -kv[1][0]):
        was = before.get(f)
        old = (f" {was[0]:7.1f} {was[2]:5d}" if was else f" {'-':>7s} {'-':>5s}") if compare else ""
        print(f"  {c:7.1f} {wl:7.1f} {n:5d}{old}  {f}")
    for f in sorted(set(before) - set(per_file)):
        print(f"  {'-':>7s} {'-':>7s} {'-':>5s} {before[f][0]:7.1f} {before[f][2]:5d}  {f}")
    if compare:
        print(f"  total CPU {sum(v[0] for v in per_file.values()):.0f} s, was {sum(v[0] for v in before.values()):.0f} s")
    print(f"\nthe {top} longest tests (wall s, CPU s, phases as [wall, CPU]):")
    for r in sorted(rows, key=lambda r: -r["wall"])[:top]:
        ph = " ".join(f"{k}={v}" for k, v in r["phases"].items() if v[0] >= 0.5)
        print(f"  {r['wall']:6.1f} {r['cpu']:6.1f}  {r['worker']:5s} {r['nodeid']}  {ph}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--compare", type=Path, default=None, help="another run's folder: each file's CPU beside it")
    args = ap.parse_args()
    report(args.folder, args.top, args.compare)


if __name__ == "__main__":
    main()
