"""Suite-wide pytest configuration: hypothesis profiles, the markers derived from what a test drives, xdist scheduling.

Profiles follow PyTorch's practice: `ci` is derandomized with no example database, so a
CI run is a pure function of the code; `dev` is quick; `thorough` is for nightly runs.
"""
from __future__ import annotations

import functools
import gc
import os
import re
import shutil
import tempfile
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, settings

from harness.engines.shared_memo import SHARED_MEMO_ENV

if TYPE_CHECKING:
    from runners.parallel.layout import ParallelLayout

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=15, deadline=None, print_blob=True)
settings.register_profile(
    "thorough",
    max_examples=1000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)

# a separate pytest project (its own pytest.ini and conftest enabling harness.plugin): tests/test_plugin.py runs it
collect_ignore = ["tests/external_project"]


def pytest_configure(config: pytest.Config) -> None:
    _share_launch_memo(config)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # before anything initialises CUDA: this worker's GPUs only
        from harness.ranks.gpu_slice import apply_worker_slice

        apply_worker_slice()
    # the suite's profile (benchmarks/suite_profile.py) records where its time goes whenever its folder is set; `-p
    # benchmarks.suite_profile` loads it too, under `python -m pytest` (the bare `pytest` script's path lacks the repo)
    if os.environ.get("SPECHARNESS_PROFILE_DIR") and not config.pluginmanager.has_plugin("benchmarks.suite_profile"):
        config.pluginmanager.import_plugin("benchmarks.suite_profile")
    # --hypothesis-profile (hypothesis' own pytest option) wins; it loads the profile itself.
    if not config.getoption("hypothesis_profile", default=None):
        settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


def _share_launch_memo(config: pytest.Config) -> None:
    """One launch memo folder for the run (harness/engines/launch_memo.py): the engine checks the tests start, each a
    process of its own (a release and its planted copies side by side, in every worker), interpret a launch they share
    once. Made by the process pytest started (xdist's controller, or the one process), before it starts any other: the
    workers and the checks inherit the variable; removed when that process ends. A folder the user set is used and kept."""
    if os.environ.get(SHARED_MEMO_ENV):
        return
    folder = tempfile.mkdtemp(prefix="specharness-launch-memo-")
    os.environ[SHARED_MEMO_ENV] = folder
    config.add_cleanup(functools.partial(shutil.rmtree, folder))


# Modules whose module-scoped fixture is costly (a wheel built and installed; the vLLM and vllm-ascend checks; SGLang
# checks of every layout): under `-n N` or `--dist loadgroup` each is one unit of work, its tests run back to back on
# one worker and the fixture is set up once; every other test is a unit of its own, handed to whichever worker is free.
# (The last three's checks also go through tests/helpers/shared.py: computed once whichever workers ask, as under
# `--dist worksteal`, which this grouping does not reach.)
SHARED_SETUP = ("test_packaging.py", "test_engine_vllm.py", "test_engine_check.py", "test_engine_vllm_ascend.py", "test_engine_eager.py",
                "test_engine_sglang_runners.py")
PLUGIN_ITEMS = "::specharness::"  # harness.plugin's case items (tests/conftest.py enables it), grouped per case
# Modules of long tests (subprocesses, engine imports, real ranks), handed out first: xdist gives tests to whichever
# worker is free in collection order, so the ones that start last should be short. Only wall time depends on it.
LONG_FIRST = ("test_engine_vllm.py", "test_plugin_engine.py", "test_engine_gather.py", "test_engine_verify.py", "test_packaging.py", "test_plugin.py",
              "test_engine_planted.py", "test_engine_check.py", "test_properties.py", "test_real_ranks.py", "test_torchrun.py",
              "test_distributed_ranks.py", "test_spec_decode.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    items.sort(key=lambda it: LONG_FIRST.index(it.path.name) if it.path.name in LONG_FIRST else len(LONG_FIRST))

    have_gpu = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    for item in items:
        for name in derived_markers(item):
            item.add_marker(name)
        if ("gpu" in item.keywords or "multigpu" in item.keywords) and not have_gpu:
            item.add_marker(skip_gpu)
            continue
        multi = item.get_closest_marker("multigpu")
        reason = _multigpu_skip_reason(item.nodeid, multi) if multi is not None else None
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, the runners, every test module) and built (the items) lives until the session
    ends. After one last collection it is frozen into the garbage collector's permanent generation, so the full
    collections the tests trigger as they allocate skip it instead of walking it again each time (gc.freeze); what
    the tests make is collected as before. gc.get_objects() no longer lists frozen objects: the engine interpreter's
    memory guard, which finds live tensors through it, thaws the heap first (harness/engines/interpreter.py)."""
    gc.collect()
    gc.freeze()
    # one intra-op thread: the suite's tensors are tiny (a few KiB), where a second pool thread only spins beside the
    # other xdist workers (one per core); the ranks run on one thread each already (one_torch_thread). torch is
    # imported by now (collection imported it), as in pytest_collection_modifyitems
    import torch

    torch.set_num_threads(1)


LARGE_WORLD = 16  # ranks: world_large from here (the 32- and 16-rank shipped cases)
_PROPERTY = re.compile(r"(?:^|_)p([1-8])(?=_|$)")  # test_p6_..., test_p1_p3_p4_..., test_p7.py


def derived_markers(item: pytest.Item) -> set[str]:
    """The markers a test's file, name and parameters imply (pyproject.toml registers them): pN for a property the test
    names (test_p6_acceptance_...) or takes as a parameter ("P6"); the gather branch and world_large for a layout, a
    case or a shipped case's name among its parameters. (engine is written on the tests themselves: the release gate
    refuses a test without it, tests/helpers/engine_releases.py.)"""
    marks = set()
    name = getattr(item, "originalname", item.name)
    for text in (item.path.stem, name):
        marks.update(f"p{n}" for n in _PROPERTY.findall(text))
    params = getattr(getattr(item, "callspec", None), "params", {})
    plugin_case = getattr(item.parent, "case", None)  # harness.plugin's items: <case>::<property>
    if plugin_case is not None and re.fullmatch(r"P[1-8]", item.name):
        marks.add(item.name.lower())
    for value in [*params.values(), plugin_case]:
        if isinstance(value, str) and re.fullmatch(r"P[1-8]", value):
            marks.add(value.lower())
        layout = _layout_of(value)
        if layout is not None:
            marks.add(f"branch_{layout.branch.value}")
            if layout.world_size >= LARGE_WORLD:
                marks.add("world_large")
    return marks


def _layout_of(value: object) -> "ParallelLayout | None":
    """The ParallelLayout a parameter stands for: itself, a case's, or a shipped case's by name; else None."""
    # imported here, as torch above: a session that collects nothing (--help, --version) never pays for them
    from harness.cases.case import Case
    from runners.parallel.layout import ParallelLayout

    if isinstance(value, ParallelLayout):
        return value
    if isinstance(value, Case):
        return value.layout
    if isinstance(value, str):
        return _shipped_layouts().get(value)
    return None


@functools.cache
def _shipped_layouts() -> "dict[str, ParallelLayout]":
    from harness.cases.case import default_cases

    return {case.name: case.layout for case in default_cases()}


def _multigpu_skip_reason(nodeid: str, marker: pytest.Mark) -> str | None:
    """multigpu(n): skip unless this xdist worker's GPU slice holds n GPUs (harness/ranks/gpu_slice.py)."""
    from harness.ranks.gpu_slice import require_gpus

    if len(marker.args) != 1 or not isinstance(marker.args[0], int) or marker.args[0] < 1:
        raise pytest.UsageError(f"{nodeid}: @pytest.mark.multigpu takes one positive int, the GPUs it needs; got {marker.args!r}")
    return require_gpus(marker.args[0])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker per core, as os.cpu_count() counts them (xdist's own default counts physical cores where
    psutil is installed, so the count would depend on an optional package). The suite computes far more than it waits
    (rank and engine processes starting, torchrun rendezvous, timeouts that must expire), so a worker beyond the cores
    finds no idle core to fill and only adds its processes to the contention. Results do not depend on the count."""
    return os.cpu_count() or 1


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`-n N` (xdist's default `load`) or `--dist loadgroup`, with the groups SHARED_SETUP names. xdist's own loadgroup reads xdist_group marks through a
    suffix it writes into item._nodeid, which pytest 9's nodeid no longer reads, so its groups split; this scheduler
    groups on the node ids themselves, in _split_scope, where xdist's own loadfile and loadgroup schedulers do."""
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None  # an explicit loadfile / loadscope / worksteal: xdist's own
    from xdist.scheduler import LoadScopeScheduling  # the plugin this hook belongs to: present whenever it is called

    class SharedSetupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if PLUGIN_ITEMS in nodeid:  # a case's property items share one run of it: one worker runs them all
                return nodeid.rsplit("::", 1)[0]
            path = nodeid.split("::", 1)[0]
            return path if path.rsplit("/", 1)[-1] in SHARED_SETUP else nodeid

    return SharedSetupScheduling(config, log)
