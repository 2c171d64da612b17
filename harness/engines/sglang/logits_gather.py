"""The logits processor's DP gather, run as the engine runs it: every TP rank of a layout at once.

Why: with DP attention and no dp lm_head the engine's LogitsProcessor gathers every DP group's
pruned hidden rows into one buffer sized from global_num_tokens_for_logprob (its start and count
per group read from the gpu tensor the replay fill wrote), runs lm_head on all of them (a vocab
shard per TP rank), all-gathers the vocabulary and scatters each group's rows back
(docs/properties.md, I2 and I4). A wrong count there hands a group zero rows or another group's logits, which
the record invariants (I1-I6) see only as a count. Here the engine's own
`LogitsProcessor._get_logits` -- its `compute_dp_attention_metadata`, `dp_gather_replicate`,
lm_head call, TP all-gather and `dp_scatter` -- runs at every replay of a layout whose processor
gathers, on every TP rank, with the batch the graph launched with: the capture-time forward
batch (host values as baked) holding the gathered gpu tensors as the replay fill left them, and
the stand-in model's hidden rows (after_model.py) through the engine's own row selection. The
lm_head is a seeded weight, sharded by vocabulary as a VocabParallelEmbedding is.

The check (`dp-gather`): each rank gets back, row for row, lm_head applied to its own pruned rows.

Ranks are threads of harness.ranks.SimulatedWorld, whose rendezvous meets every rank's call of
`get_tp_group().all_reduce` / `all_gather` (the engine's TP group is the layout's WORLD group) and
names a desynchronised rank. The engine reads its rank from process state (configure_process sets
it per rank), so the threads take turns: one holds the process (the baton) while it runs engine
code and hands it on while it waits in a collective; whoever takes it back re-publishes its rank.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from harness.engines.after_model import SEED, hidden_rows
from harness.engines.sglang.errors import EngineAdapterError, MissingEngineAttribute, require
from harness.engines.sglang.handle import RunnerHandle
from harness.engines.sglang.loader import Engine
from harness.engines.sglang.process import configure_process
from harness.ranks.sim_failures import RankFailure
from harness.ranks.simulated import SimulatedWorld
from harness.verdict import Verdict
from runners.parallel.comm import Group
from runners.parallel.layout import ParallelLayout

CHECK = "dp-gather"
# fp32 (torch.testing's defaults for float32): the gathered lm_head multiplies a [G, H] buffer by a vocab shard,
# the reference multiplies the rank's own [n, H] rows by the whole weight; the same products, reduced over H by
# differently shaped matmuls, may round differently in the last bit. A misplaced row is off by O(1).
RTOL, ATOL = 1.3e-6, 1e-5


@dataclass
class GatherInput:
    """One rank's launch of one runner: what its logits processor is handed."""

    raw_bs: int
    bs: int
    meta: Any  # the engine's LogitsMetadata for the launched batch, its buffers cloned at launch
    hidden: torch.Tensor  # the rows the engine's row selection feeds lm_head (the stand-in model's hidden states)


@dataclass
class Launches:
    """One iteration's launches of a runner, one per DP group."""

    iteration: int
    dp_sizes: tuple[int, ...]  # each group's raw batch size
    groups: dict[int, GatherInput]


def _mixed(dp_sizes: tuple[int, ...]) -> bool:
    return len(set(dp_sizes)) > 1


class _Current(threading.local):
    rank: int = 0
    comm: Any = None
    baton: Optional["_Baton"] = None


_CURRENT = _Current()


class _Baton:
    """The process, held by one rank's thread at a time; taking it re-publishes that rank (switch)."""

    def __init__(self, switch: Callable[[int], None]) -> None:
        self._lock, self._switch = threading.Lock(), switch

    @contextlib.contextmanager
    def held(self, rank: int) -> Iterator[None]:
        with self._lock:
            self._switch(rank)
            yield

    @contextlib.contextmanager
    def handed_on(self, rank: int) -> Iterator[None]:
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()
            self._switch(rank)


class SimTPGroup:
    """One of the engine's groups (its TP group, get_tp_group(); its attention-TP group) for every rank: sizes, and
    collectives met in the SimulatedWorld over the layout's group of the same ranks."""

    cpu_group = device_group = None

    def __init__(self, name: str, group: Group, world_size: int, rank_of: Callable[[int], int]) -> None:
        self.unique_name, self._group, self.world_size, self._rank_of = name, group, world_size, rank_of

    @property
    def rank_in_group(self) -> int:
        return self._rank_of(_CURRENT.rank)

    @property
    def rank(self) -> int:
        """The global rank, as a GroupCoordinator's `rank` is (rank_in_group is the place in this group)."""
        return _CURRENT.rank

    def _meet(self, op: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        if _CURRENT.comm is None or _CURRENT.baton is None:
            raise MissingEngineAttribute("the engine ran a TP collective outside the adapter's simulated gather")
        with _CURRENT.baton.handed_on(_CURRENT.rank):
            return op(_CURRENT.comm)

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        return self._meet(lambda comm: comm.all_reduce(input_, self._group))

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        moved = input_.movedim(dim, 0).contiguous()  # the rendezvous concatenates along dim 0, in group-rank order
        return self._meet(lambda comm: comm.all_gather(moved, self._group)).movedim(0, dim).contiguous()

    def all_gather_into_tensor(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        output.copy_(self._meet(lambda comm: comm.all_gather(input_.contiguous(), self._group)).view_as(output))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise MissingEngineAttribute(f"the engine used {self.unique_name}_group.{name}; the adapter's simulated group has all_reduce / all_gather only")


class _Head:
    """A VocabParallelEmbedding's shard as lm_head reads it: a weight of the rank's vocab rows."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight


def lm_head_weight(vocab: int, hidden: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randn(vocab, hidden, generator=g)


class GatherCheck:
    """Per layout whose processor gathers: each rank's launches, keyed by (iteration, runner, step), then the joint run."""

    def __init__(self, engine: Engine, layout: ParallelLayout, server_args: Any, vocab: int, hidden: int) -> None:
        self.engine, self.layout, self.server_args = engine, layout, server_args
        self.weight = lm_head_weight(vocab, hidden)
        self.groups = {"tp_group": SimTPGroup("tp", Group.WORLD, layout.tp_size, lambda r: r),
                       "attn_tp_group": SimTPGroup("attn_tp", Group.ATTN_TP, layout.attn_tp_size, layout.attn_tp_rank)}
        self.inputs: dict[tuple[str, int, int], Launches] = {}  # (runner, step, bucket) -> the launches kept
        self.where: tuple[int, int, tuple[int, ...]] = (0, 0, ())  # (iteration, DP group, each group's raw_bs) of the replays now running
        self.states = RankStates(engine, layout, server_args, self.groups, hidden)
        self._processors: dict[int, Any] = {}

    # ---- recording, at each launch (RunnerHandle.on_launch) ----
    def take(self, h: RunnerHandle, bs: int) -> None:
        """Keep one iteration per (runner, step, bucket): the first whose DP groups hold different batch sizes (else the
        first). The gather reads only the launch's counts and rows; the counts are the bucket's whatever the batch, so
        other batches of the bucket gather the same, except where a fill wrongly follows a group's own batch size,
        which the mixed one shows. Every group runs the same schedule, so all of them keep the same iteration."""
        it, d, dp_sizes = self.where
        key = (h.kind, h.step, bs)
        kept = self.inputs.get(key)
        if kept is None or (kept.iteration != it and _mixed(dp_sizes) and not _mixed(kept.dp_sizes)):
            kept = self.inputs[key] = Launches(it, dp_sizes, {})
        if kept.iteration != it:
            return
        lp = self.engine.modules["logits"]
        fb = h.launched_batch(bs)
        meta = lp.LogitsMetadata.from_forward_batch(fb)
        for f in dataclasses.fields(meta):  # the runner's buffers change with the next replay: keep their launch values
            v = getattr(meta, f.name)
            if isinstance(v, torch.Tensor):
                setattr(meta, f.name, torch.zeros_like(v) if f.name == "next_token_logits_buffer" else v.clone())
        hidden = h.pruned_states(fb, hidden_rows(fb.input_ids, self.weight.shape[1]))
        kept.groups[d] = GatherInput(dp_sizes[d], bs, meta, hidden.clone())

    # ---- the joint run ----
    def processor_gathers(self) -> bool:
        """The engine's own decision (LogitsProcessor.__init__) for this layout, as seen from rank 0."""
        return bool(self.processor(0).do_tensor_parallel_all_gather_dp_attn)

    def processor(self, rank: int) -> Any:
        """The rank's LogitsProcessor, built under its rank's process state (its __init__ reads it)."""
        if rank not in self._processors:
            with self.states.serving(rank):
                self._processors[rank] = self.engine.modules["logits"].LogitsProcessor(_Config(self.weight.shape[0]))
        return self._processors[rank]

    def run(self, inputs: dict[int, GatherInput]) -> list[torch.Tensor]:
        """Every TP rank's _get_logits on its DP group's launch, collectives met across the threads."""
        lay, tp = self.layout, self.layout.tp_size
        shard = self.weight.shape[0] // tp
        baton = _Baton(self.states.switch)
        processors = {r: self.processor(r) for r in range(tp)}

        def rank_main(comm: Any) -> torch.Tensor:
            r = comm.rank
            _CURRENT.comm, _CURRENT.baton = comm, baton
            try:
                with baton.held(r):
                    mine = inputs[lay.attn_dp_rank(r)]
                    meta = dataclasses.replace(mine.meta)  # compute_dp_attention_metadata writes into it: one per rank
                    if meta.next_token_logits_buffer is not None:
                        meta.next_token_logits_buffer = torch.zeros_like(meta.next_token_logits_buffer)
                    head = _Head(self.weight[r * shard:(r + 1) * shard])
                    return processors[r]._get_logits(mine.hidden.clone(), head, meta).clone()
            finally:
                _CURRENT.comm = _CURRENT.baton = None

        try:
            return SimulatedWorld(lay, timeout_s=60.0).run(rank_main)
        finally:
            self.states.release()

    def check(self, line: Callable[[str, int, int], Any], w: dict) -> Optional[str]:
        """The dp-gather check on every recorded launch: rank r's logits = lm_head(its own pruned rows)."""
        lay = self.layout
        if not self.inputs:  # every replay of the layout failed before its launch (those failures are on their own lines)
            v = line("multi_layer", 0, None).verdict
            v.checked += 1
            v.fail(CHECK, "launches", {**w, "runner": "multi_layer"}, "every runner's launches on every DP group", "none",
                   "no replay of this layout reached its graph launch, so its logits processor's DP gather ran on nothing")
            return None
        for (kind, step, bs), kept in sorted(self.inputs.items(), key=lambda kv: (kv[0][0] != "multi_layer", kv[0][1:])):
            it, per_group = kept.iteration, kept.groups
            v: Verdict = line(kind, step, bs).verdict
            where = {**w, "runner": kind, "step": step, "iteration": it, "bs": bs}
            if sorted(per_group) != list(range(lay.attn_dp_size)):  # the groups disagree on the bucket: nothing to gather together
                v.checked += 1
                v.fail(CHECK, "DP groups launching the bucket", {**where, "dp_batch_sizes": list(kept.dp_sizes)}, list(range(lay.attn_dp_size)),
                       sorted(per_group), "every DP group replays the bucket the largest group's batch needs, so all of them launch "
                       "it in the same iteration; a group missing here padded to another bucket (the gathered buffer would mix shapes)")
                continue
            try:
                outs = self.run(per_group)
            except RankFailure as e:
                if isinstance(e.root_exception, MissingEngineAttribute):
                    return _not_applicable(self.engine, e.root_exception)
                v.checked += 1
                v.fail(CHECK, "logits", {**where, "rank": e.root_rank}, "each rank's logits", f"the gather raised: {e.root_exception!r}",
                       "the engine's logits processor gather, run on every TP rank")
                continue
            for r, got in enumerate(outs):
                mine = per_group[lay.attn_dp_rank(r)]
                want = mine.hidden @ self.weight.T
                compare(v, {**where, "rank": r, "raw_bs": mine.raw_bs}, want, got)
        return None


def compare(v: Verdict, where: dict, want: torch.Tensor, got: torch.Tensor) -> None:
    v.checked += 1
    n = int(want.shape[0])
    if got.shape[0] < n or got.shape[1:] != want.shape[1:]:
        v.fail(CHECK, "logits shape", where, f"at least {n} rows of {want.shape[1]}", tuple(got.shape),
               "the rank's scattered logits: one row per row it fed lm_head")
        return
    close = torch.isclose(got[:n], want, rtol=RTOL, atol=ATOL).all(dim=1)
    if bool(close.all()):
        return
    row = int((~close).nonzero()[0, 0])
    v.fail(CHECK, "logits", {**where, "row": row}, f"lm_head(row {row} of this rank's pruned hidden states)",
           _describe(got[row], want, row),
           "after the DP gather / lm_head / TP all-gather / dp_scatter: this rank's own rows, in order (fp32 rtol 1.3e-6, atol 1e-5)")


def _describe(got_row: torch.Tensor, want: torch.Tensor, row: int) -> str:
    """What came back instead: zeros, another of this rank's rows, or something else."""
    if not bool(got_row.any()):
        return "a zero row (no rows gathered there)"
    match = torch.isclose(want, got_row[None, :], rtol=RTOL, atol=ATOL).all(dim=1).nonzero()
    if match.numel():
        return f"the logits of this rank's row {int(match[0, 0])}"
    return "logits of no row of this rank (another DP group's rows, or garbage)"


@dataclass
class _Config:
    """The model config LogitsProcessor.__init__ reads: the vocabulary, no softcapping or fp32 lm_head."""

    vocab_size: int
    final_logit_softcapping: Optional[float] = None


class RankStates:
    """The process state of each TP rank of a layout, and switching between them.

    Where the release can hold one runtime context per rank (create_context / use_context, "for serialized
    embedded work": the baton serializes) each rank's is built once and switched to; elsewhere the rank is
    re-published by configure_process (module globals: cheap). Either way the rank's TP group is the simulated
    one and the DP gathered buffer's metadata (hidden size, dtype, device) is set, as the model runner's
    init_dp_gathered_buffer would.
    """

    def __init__(self, engine: Engine, layout: ParallelLayout, server_args: Any, groups: dict[str, SimTPGroup], hidden: int) -> None:
        self.engine, self.layout, self.server_args, self.groups, self.hidden = engine, layout, server_args, groups, hidden
        rc = engine.modules.get("runtime_context")
        self._rc = rc if rc is not None and hasattr(rc, "create_context") and hasattr(rc, "use_context") else None
        self._contexts: dict[int, Any] = {}
        self._active = contextlib.ExitStack()

    def switch(self, rank: int) -> None:
        self._active.close()
        if self._rc is None:
            configure_process(self.engine, self.server_args, self.layout, rank)
            self._install()
        else:
            fresh = rank not in self._contexts
            if fresh:
                self._contexts[rank] = self._rc.create_context(self.server_args, role="scheduler",
                                                               ranks=require(self._rc, "SpawnRanks", self.engine.version)(world_rank=rank))
            self._active.enter_context(self._rc.use_context(self._contexts[rank]))
            if fresh:
                self._install()
        _CURRENT.rank = rank

    def release(self) -> None:
        """Back to the process state the adapter published for the replays (rank 0 of the layout: check.py's first
        DP group, whose runners replay after the setup; later groups re-publish their own)."""
        self._active.close()
        if self._rc is None:
            configure_process(self.engine, self.server_args, self.layout, 0)

    @contextlib.contextmanager
    def serving(self, rank: int) -> Iterator[None]:
        self.switch(rank)
        try:
            yield
        finally:
            self.release()

    def _install(self) -> None:
        """Where this release's get_tp_group() reads the group: its parallel context where it has one (the
        attention-TP group too, which LogitsProcessor.__init__ reads there), and parallel_state._TP where that
        global exists (the attention-TP group stays the adapter's sized stand-in there)."""
        eng = self.engine
        rc = eng.modules.get("runtime_context")
        par = rc.get_parallel() if rc is not None and hasattr(rc, "get_parallel") else None
        if par is not None and hasattr(par, "override_permanently"):
            par.override_permanently(**self.groups)
        ps = eng.modules["parallel_state"]
        if hasattr(ps, "_TP"):
            ps._TP = self.groups["tp_group"]
        elif par is None:
            raise EngineAdapterError(f"sglang {eng.version}: neither a parallel context nor parallel_state._TP holds the TP group")
        wrapper = require(eng.modules["dp_attention"], "_DpGatheredBufferWrapper", eng.version, "the DP gathered buffer's metadata")
        wrapper.set_metadata(hidden_size=self.hidden, dtype=torch.float32, device=torch.device("cpu"))


def setup(engine: Engine, layout: ParallelLayout, server_args: Any, vocab: int, hidden: int, v: Verdict,
          w: dict) -> tuple[Optional[GatherCheck], Optional[str]]:
    """The gather check for this layout, if the engine's processor gathers here (else None); the reason where this
    release's gather cannot be driven (n/a, never an adapter error). Our rule (DP attention, no dp lm_head, tp > 1:
    ParallelLayout.logits_dp_gather) is checked against the engine's own decision on the way."""
    try:
        gc = GatherCheck(engine, layout, server_args, vocab, hidden)
        gathers = gc.processor_gathers()
    except (MissingEngineAttribute, EngineAdapterError, RuntimeError) as e:  # RuntimeError: a context value this release wants written
        return None, _not_applicable(engine, e)
    v.expect_equal(CHECK, "do_tensor_parallel_all_gather_dp_attn", w, layout.logits_dp_gather, gathers,
                   "the processor gathers across DP groups iff DP attention, no dp lm_head, tp > 1")
    return (gc if gathers else None), None


def _not_applicable(engine: Engine, e: BaseException) -> str:
    return f"logits processor DP gather ({CHECK}): n/a on sglang {engine.version}: its LogitsProcessor / dp_attention API is not the one the check drives ({e})"
