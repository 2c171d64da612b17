"""P8 batch churn: a hypothesis state machine adds, finishes, preempts and resumes requests
across bucket boundaries with eager and graph engines side by side; the invariants of
`harness.props.p8.ChurnPair` (KV bookkeeping, scheduler state, tokens, accept lengths, draft
outputs, live KV, lossless output) are checked after every step. Plus the fixed-script probe and
the mutants P8 kills."""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from harness import mutants
from harness.props.p8 import CHURN_RUNS, CHURN_SPEC, ChurnPair, run_churn_script
from runners.config import SpecConfig
from runners.parallel.layout import ParallelLayout as PL

# Each example builds two engines (graph capture included) and runs up to STEPS scheduler
# iterations, about a second: a tenth of the profile's example budget (ci: 6, dev: 2).
EXAMPLES = max(2, settings().max_examples // 10)
STEPS = 12


class BatchChurn(RuleBasedStateMachine):
    """Every rule is one scheduler iteration: its event(s), then a step of both engines, checked."""

    layout = PL()
    spec = CHURN_SPEC

    @initialize()
    def build(self):
        self.pair = ChurnPair(self.layout, self.spec)
        self.dp = self.layout.attn_dp_size

    def _step(self):
        self.pair.step()
        assert self.pair.v.ok, self.pair.v.report(8)

    @rule(d=st.integers(0, 3), k=st.integers(1, 4))
    def add(self, d, k):
        self.pair.add(d % self.dp, k)
        self._step()

    @precondition(lambda self: any(self.pair.running))
    @rule(d=st.integers(0, 3), i=st.integers(0, 7), k=st.integers(1, 3))
    def finish(self, d, i, k):
        for _ in range(k):  # several at once: the batch shrinks across a bucket boundary
            self.pair.finish(d % self.dp, i)
        self._step()

    @precondition(lambda self: any(self.pair.running))
    @rule(d=st.integers(0, 3), i=st.integers(0, 7), resume=st.booleans())
    def preempt(self, d, i, resume):
        self.pair.preempt(d % self.dp, i)
        if resume:  # back in the same iteration: re-prefilled at once, into another lane
            self.pair.resume(d % self.dp)
        self._step()

    @precondition(lambda self: any(self.pair.waiting))
    @rule(d=st.integers(0, 3))
    def resume(self, d):
        self.pair.resume(d % self.dp)
        self._step()

    @rule()
    def step(self):
        self._step()

    @invariant()
    def shadow_scheduler_fits(self):
        assert all(len(r) <= self.spec.max_running_requests for r in self.pair.running)

    def teardown(self):
        """The graph engine ran its graphs: no batch fell back to eager (the largest bucket holds every running request),
        and once a request was verified every graph runner had replayed. Else eager-vs-graph compared eager with eager."""
        if not hasattr(self, "pair"):
            return
        engines = self.pair.graph.engines
        stats = [e.draft.driver.stats for e in engines] + [e.verify_graph.backend.stats for e in engines]
        stats += [e.draft.decode_graph.backend.stats for e in engines if e.draft.decode_graph is not None]
        assert sum(s.eager_fallbacks for s in stats) == 0
        if any(rep.verified for reps in self.pair.graph.reports for rep in reps):
            v = self.pair.finish_check()
            assert v.ok, v.report()


class BatchChurnDP2(BatchChurn):
    """MLP-TP gather over two DP groups: one bucket for both, idle groups run the padded dummy."""

    layout = PL(2, 2, True)
    spec = SpecConfig(num_steps=2, topk=1, capture_bs=(1, 2, 4), max_running_requests=4)


TestBatchChurn = BatchChurn.TestCase
TestBatchChurn.settings = settings(settings(), max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None)
TestBatchChurnDP2 = BatchChurnDP2.TestCase
TestBatchChurnDP2.settings = settings(settings(), max_examples=max(1, EXAMPLES // 2), stateful_step_count=STEPS, deadline=None)


@pytest.mark.parametrize("layout,script,spec", CHURN_RUNS,
                         ids=lambda x: x.describe() if isinstance(x, PL) else x.draft if isinstance(x, SpecConfig) else "script")
def test_p8_fixed_script_holds(layout, script, spec):
    v = run_churn_script(layout, script, spec)
    assert set(v) == {"P8"} and v["P8"], v["P8"].report()
    assert v["P8"].checked > 500


def test_p8_kills_stale_padded_lanes_after_a_shrink():
    """Co-killed with P2 (which sees the non-canonical padded lanes): here the stale lanes' request
    rows send their in-graph KV writes into slots a live request was handed right after another finished."""
    layout, script, _ = CHURN_RUNS[0]
    with mutants.get("stale-padded-req-pool-indices").planted():
        v = run_churn_script(layout, script)["P8"]
    assert not v
    f = v.failures[0]
    assert f.check == "eager-vs-graph" and "request" in f.where, f.message()
    assert f.where["step"] > 1  # only after the batch shrank


def test_p8_kills_a_padded_kv_write_into_a_live_slot():
    layout, script, _ = CHURN_RUNS[0]
    with mutants.get("padded-kv-write-live-slot").planted():
        v = run_churn_script(layout, script)["P8"]
    assert not v and v.failures[0].check == "eager-vs-graph"


def test_churn_pair_rules_keep_the_shadow_scheduler_honest():
    pair = ChurnPair(PL(), SpecConfig(num_steps=2, capture_bs=(1, 2, 4), max_running_requests=4))
    pair.add(0, 6)
    assert len(pair.running[0]) == 4  # bounded by max_running_requests
    pair.step()
    pair.preempt(0, 1)
    pair.finish(0, 0)
    pair.step()
    assert len(pair.running[0]) == 2 and len(pair.waiting[0]) == 1
    pair.resume(0)
    pair.step()
    assert pair.v, pair.v.report()
    assert {r.rid: r.preemptions for r in pair.graph.requests().values()}[pair.running[0][-1]] == 1


def test_p8_churn_over_the_draft_decode_sees_a_stale_request_row():
    """The single-layer run: the draft decode's padded lanes keep a finished request's row after a shrink; their
    in-graph KV writes land in a live request's draft slots and that request's graph tree differs from eager."""
    layout, script, spec = CHURN_RUNS[2]
    assert spec.draft == "single_layer"
    with mutants.get("decode-fill-req-pool-indices").planted():
        v = run_churn_script(layout, script, spec)["P8"]
    assert not v and v.failures[0].where.get("draft") == "decode", v.report()
