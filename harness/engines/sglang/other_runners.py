"""SGLang's speculative graph runners beyond the EAGLE ones, driven on their own report lines.

Each entry names a runner kind (its `--runner` name), how to load it from a release (the module
and the reason it is n/a where it cannot be driven), how to build it on one rank's stand-ins
(build.EngineRunners.stand_ins) and how to check its replays. check.py drives every entry the
selection wants on the ranks the entry runs on, each call guarded (a raise is a finding of that
runner's whole-runner line), and reports what an entry never checks under `skipped`, always.

* frozen_kv_mtp (frozen_kv_mtp.py): the Frozen-KV MTP draft loop's DECODE graphs (0.5.14 on), on
  every layout: P1 with the per-DP-rank counts, the padding rules and the padded lanes;
* uno (uno.py): UNO's F-wide TARGET_VERIFY graphs (0.5.20 on), a LoRA and a no-LoRA graph per bucket,
  on the one layout UNO runs on (TP 1, no DP attention);
* ragged_verify (ragged_verify.py): the target's verify graphs keyed by token tier (0.5.16 on, the
  compact ragged-verify mode of DSpark), on DSpark's layouts;
* dflash_verify (dflash_verify.py): the target's verify graphs for DFLASH's block (0.5.14 on), on the layouts
  DFlash accepts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from harness.engines.sglang import dflash_verify, frozen_kv_mtp, ragged_verify, uno
from runners.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class OtherRunner:
    kind: str
    title: str  # the engine's class, as the report names it
    load: Callable[[Any], tuple[Any, str]]  # (what build needs, "") or (None, why it is n/a)
    build: Callable[[Any, Any], Any]  # (loaded, the rank's stand-ins) -> the driven runner
    check: Callable[..., None]  # (runner, layout, d, tp_rank, line, per_request[, shared: where finish is given])
    never: tuple[str, ...] = ()  # what it never checks, with why: said in every report that drives it
    # the layouts it runs on, from the run's (layout, why), where they are not the run's own: a runner whose engine
    # accepts other layouts than the representative ones (UNO: tp1 only)
    own_layouts: Optional[Callable[[tuple[ParallelLayout, ...]], tuple[tuple[ParallelLayout, str], ...]]] = None
    # after every DP group of a layout: (layout, what the groups' checks kept in `shared`, line) -- checks across DP groups
    finish: Optional[Callable[[ParallelLayout, dict, Callable], None]] = None

    def ranks(self, layouts: tuple[ParallelLayout, ...]) -> list[tuple[ParallelLayout, int, int]]:
        """(layout, DP group, its first TP rank) this runner is driven on: the first rank of every DP group."""
        lays = [lay for lay, _ in self.own_layouts(layouts)] if self.own_layouts is not None else list(layouts)
        return [(lay, d, d * lay.attn_tp_size) for lay in lays for d in range(lay.attn_dp_size)]


OTHER_RUNNERS: tuple[OtherRunner, ...] = (
    OtherRunner(frozen_kv_mtp.KIND, "FrozenKVMTPCudaGraphRunner", frozen_kv_mtp.load, frozen_kv_mtp.FrozenKVMTP, frozen_kv_mtp.check,
                (frozen_kv_mtp.SEED_NOT_CHECKED,)),
    OtherRunner(uno.KIND, "UnoDecodeCudaGraphRunner", uno.load, uno.Uno, uno.check, (uno.GATHER_NA, uno.TREE_MODE), uno.layouts),
    OtherRunner(ragged_verify.KIND, "DecodeCudaGraphRunner in compact ragged-verify mode", ragged_verify.load, ragged_verify.RaggedVerify,
                ragged_verify.check, ragged_verify.NEVER, ragged_verify.layouts, ragged_verify.finish),
    OtherRunner(dflash_verify.KIND, "DecodeCudaGraphRunner for DFLASH (TARGET_VERIFY)", dflash_verify.load, dflash_verify.build,
                dflash_verify.check, (dflash_verify.DFLASH_DRAFT,), dflash_verify.layouts),
)
KINDS: tuple[str, ...] = tuple(r.kind for r in OTHER_RUNNERS)
