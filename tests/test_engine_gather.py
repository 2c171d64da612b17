"""The logits processor's DP gather (harness/engines/sglang/logits_gather.py): the engine's own gather, run on every TP
rank, hands each rank the logits of its own rows; a wrong count is caught there, on the layout that gathers.

The threaded collectives are tested without an engine first (fast); then three engine checks, each in its own
process on one or two layouts: the newest release passes, a wrong count planted in its logits processor fails on
the MLP-TP gather layout only, and of the seed-bug releases the one whose single-layer runner counts bs where lm_head
sees bs * T (0.5.7) fails there while the seed bug itself (0.5.13.post1, attn-TP gather layouts) never reaches a gather.
"""
from __future__ import annotations

import json
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from harness.engines.sglang import logits_gather
from harness.ranks.simulated import SimulatedWorld
from harness.verdict import Verdict
from runners.parallel.comm import Group
from runners.parallel.layout import ParallelLayout
from tests.helpers.engine_releases import installed_release
from tests.helpers.prewarmed import run_python
from tests.test_engine_planted import NEWEST, _plant

MLP_TP = "ParallelLayout(4, 2, True)"  # the processor gathers across the two DP groups
ATTN_TP_DP = 'ParallelLayout(4, 2, True, 1, True, "deepep")'  # DP attention with dp lm_head: no DP gather of logits rows
LOGITS = "sglang/srt/layers/logits_processor.py"


# ---- the mechanism, without an engine ----


def test_simulated_groups_meet_every_rank_in_rank_order_and_republish_the_rank():
    lay = ParallelLayout(4, 2, True)
    tp = logits_gather.SimTPGroup("tp", Group.WORLD, 4, lambda r: r)
    attn = logits_gather.SimTPGroup("attn_tp", Group.ATTN_TP, 2, lay.attn_tp_rank)
    published: list[int] = []  # the rank the process describes, each time a thread takes the baton
    current = {"rank": None}

    def switch(rank: int) -> None:
        published.append(rank)
        current["rank"] = rank

    baton = logits_gather._Baton(switch)
    seen: dict[int, tuple] = {}
    lock = threading.Lock()

    def rank_main(comm) -> None:
        logits_gather._CURRENT.comm, logits_gather._CURRENT.baton, logits_gather._CURRENT.rank = comm, baton, comm.rank
        with baton.held(comm.rank):
            mine = torch.full((2, 3), float(comm.rank))
            summed = tp.all_reduce(mine)
            assert current["rank"] == comm.rank  # the process is this rank's again after the collective
            gathered = tp.all_gather(mine, dim=-1)
            assert current["rank"] == comm.rank
            within = attn.all_gather(mine, dim=0)
            with lock:
                seen[comm.rank] = (summed, gathered, within, tp.rank_in_group, attn.rank_in_group)

    SimulatedWorld(lay, timeout_s=30).run(rank_main)
    for r in range(4):
        summed, gathered, within, tp_rank, attn_rank = seen[r]
        assert torch.equal(summed, torch.full((2, 3), 6.0))  # 0 + 1 + 2 + 3
        assert gathered.is_contiguous() and gathered[0].tolist() == [0.0] * 3 + [1.0] * 3 + [2.0] * 3 + [3.0] * 3
        group = [2 * (r // 2), 2 * (r // 2) + 1]  # the attention-TP group of rank r
        assert within[:, 0].tolist() == [float(group[0])] * 2 + [float(group[1])] * 2
        assert (tp_rank, attn_rank) == (r, r % 2)
    assert len(published) == 4 * 4  # each rank: taking the baton, and back after each of its three collectives


def test_compare_names_zero_rows_and_rows_out_of_place():
    want = torch.arange(12, dtype=torch.float32).view(4, 3) + 1
    ok = Verdict("P1")
    logits_gather.compare(ok, {}, want, want.clone())
    assert ok.ok and ok.checked == 1
    zero = want.clone()
    zero[2:] = 0
    shifted = want[[0, 2, 1, 3]]
    for got, says, row in ((zero, "a zero row", 2), (shifted, "the logits of this rank's row 2", 1)):
        v = Verdict("P1")
        logits_gather.compare(v, {}, want, got)
        (f,) = v.failures
        assert (f.check, f.where["row"]) == ("dp-gather", row) and f.got.startswith(says), f


# ---- on the engine ----


def _check(target: Path, layouts: str) -> dict:
    code = f"""
        import json
        from pathlib import Path
        from harness.engines.check import check_engine
        from harness.engines.install import deps_dir
        from harness.engines.sglang.loader import load
        from runners.parallel.layout import ParallelLayout
        eng = load(Path({str(target)!r}), deps_dir())
        rep = check_engine(eng, tuple([{layouts}]), kernel_layouts=())
        print(json.dumps(dict(skipped=rep.skipped, failures=[dict(check=f.check, runner=f.where.get("runner"), step=f.where.get("step"),
                              layout=f.where.get("layout", ""), got=str(f.got)) for f in rep.failures()])))
    """
    proc = run_python(textwrap.dedent(code), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gather_failures(rep: dict) -> list[dict]:
    return [f for f in rep["failures"] if f["check"] == "dp-gather"]


pytestmark = pytest.mark.timeout(900)


@pytest.mark.engine
def test_newest_passes_and_a_wrong_count_in_its_gather_is_caught_on_the_gathering_layout(tmp_path):
    newest = installed_release(NEWEST)
    clean = _check(newest, f"{MLP_TP}, {ATTN_TP_DP}")
    assert _gather_failures(clean) == []
    assert not any("n/a" in why and "dp-gather" in why for why in clean["skipped"]), clean["skipped"]
    assert any(why.startswith("dp-gather on tp4-dp2-dense_tp1") and "nothing to run" in why for why in clean["skipped"]), clean["skipped"]
    # the gather is told each DP group holds half the rows it holds
    target = _plant(newest, tmp_path / "sglang", LOGITS, "        self.dp_local_num_tokens = self.global_num_tokens_for_logprob_gpu[dp_rank]\n",
                    "        self.dp_local_num_tokens = self.global_num_tokens_for_logprob_gpu[dp_rank] // 2\n")
    fails = _gather_failures(_check(target, f"{MLP_TP}, {ATTN_TP_DP}"))
    assert fails and {f["layout"] for f in fails} == {"tp4-dp2 [mlp_tp_gather]"}, fails
    # every runner that gathers: both multi-layer composites (the one graph: multi_layer_1g) at every step, the single-layer one
    assert {(f["runner"], f["step"]) for f in fails} == {(r, s) for r in ("multi_layer", "multi_layer_1g") for s in (0, 1, 2)} | {("single_layer", 0)}
    assert all(f["got"] == "a zero row (no rows gathered there)" for f in fails), fails


@pytest.mark.engine
def test_seed_bug_releases_where_a_wrong_count_reaches_the_gather():
    # 0.5.7's single-layer runner counts bs where lm_head sees bs * T, also in the MLP-TP branch, whose processor gathers
    sibling = _gather_failures(_check(installed_release("0.5.7"), MLP_TP))
    assert sibling and {(f["runner"], f["layout"]) for f in sibling} == {("single_layer", "tp4-dp2 [mlp_tp_gather]")}, sibling
    assert all(f["got"] == "a zero row (no rows gathered there)" for f in sibling), sibling
    # the seed bug itself lives in the attn-TP gather branch, where no processor gathers across DP groups
    seed = _check(installed_release("0.5.13.post1"), f"{MLP_TP}, {ATTN_TP_DP}")
    assert _gather_failures(seed) == [] and any(f["check"] == "I1" for f in seed["failures"]), seed["failures"][:3]
