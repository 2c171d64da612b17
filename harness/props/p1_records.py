"""P1 on one replay record: the invariants and padding rules every runner's record must hold (ours and an engine's)."""
from __future__ import annotations

from typing import Optional, Sequence

from harness.props.p1_fields import Excluded, FieldPolicy, FieldRule, check_capture_fields
from harness.run.records import ReplayRecord
from harness.verdict import Verdict
from runners.base_cuda_graph_runner import RunnerKind
from runners.draft_extend import SEQ_LEN_FILL_VALUE
from runners.parallel.layout import ParallelLayout

P1 = "P1"  # the property these checks report under (registered by harness.props.p1)

# How our runners' fields are classified where the rule of their kind is not the one (harness.props.p1_fields):
# the seq-lens sum is the live lanes' (the replay's plan sums them), the gathered counts are the bucket's.
OUR_FIELDS: FieldPolicy = {
    "seq_lens_sum": FieldRule.BATCH,
    "global_num_tokens_gpu": FieldRule.BUCKET,
    "global_num_tokens_for_logprob_gpu": FieldRule.BUCKET,
}
# The ragged draft-extend bakes the bucket's capacity, T tokens a lane, as its host extents; the replay writes each
# lane's accepted count into the device extents, which are what its graph reads (token_to_request, the KV write
# slots). The one in-graph use of the host list is the triton backend's longest extent, and T bounds every lane.
_RAGGED_EXTENTS = Excluded(
    "the bucket's capacity (T a lane) at capture, the live extents on the device at replay: the ragged graph reads the "
    "device extents; the triton backend's longest extent, from the host list, is T, which bounds every lane",
    "runners/attention/torch_ref.py:32, runners/ragged_draft_extend.py:99, runners/attention/triton_backend.py:239",
)
OUR_RUNNER_FIELDS: dict[str, FieldPolicy] = {
    RunnerKind.RAGGED: {**OUR_FIELDS, "extend_seq_lens_cpu": _RAGGED_EXTENTS, "extend_num_tokens": _RAGGED_EXTENTS},
}


def our_field_policy(runner: str) -> FieldPolicy:
    """The field classification of one of our runner kinds (runners.base_cuda_graph_runner.RunnerKind)."""
    return OUR_RUNNER_FIELDS.get(runner, OUR_FIELDS)


def verify_capture_bs(layout: ParallelLayout, configured: Sequence[int], max_running_requests: int, T: int) -> list[int]:
    """The TARGET_VERIFY buckets SGLang captures (get_batch_sizes_to_capture with the verify's
    T tokens per request): the alignment is 2 with two-batch overlap, times attn_tp_size where the
    gathered buffers are used; a bucket is kept when its model input (bs * T tokens; bs under
    two-batch overlap, whose micro-batches split requests) is a multiple of it and it fits the
    request pool rounded up to it, which is added when the list reaches past it. Where none is
    kept the engine refuses to start (an assert); our runners capture the rounded pool there
    instead, so that is the expectation (an engine never gets that far)."""
    tbo = layout.enable_two_batch_overlap
    alignment = (2 if tbo else 1) * (layout.attn_tp_size if layout.require_gathered_buffer else 1)
    per_request = 1 if tbo else T
    pool = alignment * -(-max_running_requests // alignment)
    candidates = list(configured) + ([pool] if max(configured) > pool else [])
    return sorted({b for b in candidates if b * per_request % alignment == 0 and b <= pool}) or [pool]


def record_where(layout: ParallelLayout, rec: ReplayRecord, tp_rank: int, iteration: int) -> dict:
    return {
        "layout": layout.describe(),
        "branch": rec.branch,
        "runner": rec.runner,
        "step": rec.step,
        "rank": tp_rank,
        "iteration": iteration,
        "raw_bs": rec.raw_bs,
        "bs": rec.bs,
    }


def check_replay_record(
    v: Verdict,
    layout: ParallelLayout,
    rec: ReplayRecord,
    tp_rank: int,
    iteration: int,
    needed_bs: int,
    *,
    logprob_rows: Optional[int] = None,
    require_host_lists: bool = True,
    tokens_aligned: Optional[bool] = None,
    expected_capture_bs: Optional[Sequence[int]] = None,
    pads_requests: bool = True,
    field_policy: Optional[FieldPolicy] = None,
    field_check: str = "I1",
) -> None:
    """I1, I4, I5 and the padding rules on one replay's record.

    The keyword parameters describe legal engine variants (`harness explain I5`, `harness explain I4`); their
    defaults are our runners' behaviour, and `harness engine-check` passes them for SGLang:

    logprob_rows: the logit rows per rank lm_head sees in this bucket. None (ours): every
        DRAFT_EXTEND_V2 token, bs * T, so for_logprob == num_tokens (I5) and the gathered
        buffer is Σ for_logprob (I4). A pruned-logits engine feeds lm_head one row per request
        and passes bs: then for_logprob (baked and filled) must be bs per rank, and
        global_dp_buffer_len keeps sizing the token buffer (Σ num_tokens), while the logits
        gather sizes itself from Σ for_logprob. The invariant is "for_logprob equals the rows
        given to lm_head", not a fixed formula; the caller states the rows it measured.
    require_host_lists: our runners bake both host lists, global_num_tokens_cpu and
        global_num_tokens_for_logprob_cpu, into the forward batch. An engine that gives only
        the gpu tensors for one of them (the logits processor then sizes its gather from
        global_dp_buffer_len and reads counts from the gpu tensor) passes False: an
        absent host list is not compared in I1, and I4 / I5 use the capture-time gpu value
        in its place, which is what the graph holds. A host list that is given is checked.
    tokens_aligned: the target verify's buckets are aligned by their tokens (bs * T a multiple
        of attn_tp_size: the verify's tokens are what the attn-TP ranks split), not by bs; with
        two-batch overlap by bs again. None: by the record's runner (ours: TARGET_VERIFY).
    expected_capture_bs: the buckets the engine captures for this runner (verify_capture_bs for
        the target verify); a runner that keeps fewer pads a batch past the engine's bucket.
    pads_requests: False for a PIECEWISE graph (vLLM: num_reqs None, no request padding): the lanes past the
        live ones belong to no batch, so their seq_lens have no canonical value and the metadata sums live lanes;
        the token count is still padded to the bucket's (checked).
    field_policy, field_check: I1 over every field the replay wrote (rec.fields; harness.props.p1_fields), classified
        by this policy (None: our runner kind's, `our_field_policy`; an engine's names its release's exclusions) and
        reported under this check name.
    """
    w = record_where(layout, rec, tp_rank, iteration)
    T, bs = rec.tokens_per_bs, rec.bs
    n = bs * T
    lp_rows = n if logprob_rows is None else logprob_rows
    # padding rules
    v.expect_equal("padding", "bs in capture_bs", w, True, bs in rec.captured_bs)
    v.expect_equal("padding", "bs >= raw_bs", w, True, bs >= needed_bs, f"needed {needed_bs}")
    smaller = [b for b in rec.captured_bs if needed_bs <= b < bs]
    v.expect_equal("padding", "smallest bucket", w, [], smaller, "a smaller captured bucket fits")
    if expected_capture_bs is not None:
        v.expect_equal("padding", "capture_bs", w, sorted(expected_capture_bs), sorted(rec.captured_bs), "the engine's buckets")
    if tokens_aligned is None:
        tokens_aligned = rec.runner == RunnerKind.TARGET_VERIFY
    if layout.require_gathered_buffer:
        if tokens_aligned and not layout.enable_two_batch_overlap:
            v.expect_equal("padding", "bs * T % attn_tp_size", w, 0, n % layout.attn_tp_size)
        else:
            v.expect_equal("padding", "bs % attn_tp_size", w, 0, bs % layout.attn_tp_size)
    if pads_requests:
        v.expect_equal("padding", "padded seq_lens", w, [SEQ_LEN_FILL_VALUE] * (bs - rec.raw_bs), rec.padded_seq_lens)
        v.expect_equal("padding", "seq_lens_sum", w, rec.seq_lens_sum_actual, rec.seq_lens_sum, "metadata sum vs the buffer's lanes")
    if rec.host_mirror_stale_lanes is not None:
        v.expect_equal("padding", "host mirror", w, [], rec.host_mirror_stale_lanes,
                       "lanes whose host seq_lens / tree mask (what a host-planned backend plans with) differ from the device buffers")
    v.expect_equal("padding", "capture num_tokens", w, n, rec.capture.host["num_tokens"])
    if layout.require_gathered_buffer:
        _check_gathered_counts(v, layout, rec, w, n, lp_rows, logprob_rows, require_host_lists)
    else:
        v.expect_equal("padding", "global_num_tokens_gpu", w, None, rec.global_num_tokens_gpu, "no gathered buffer in this branch")
    # after the named counts, so a count's failure is reported with its values before the generic field sweep's
    check_capture_fields(v, rec, w, our_field_policy(rec.runner) if field_policy is None else field_policy, field_check)


def _check_gathered_counts(
    v: Verdict, layout: ParallelLayout, rec: ReplayRecord, w: dict, n: int, lp_rows: int,
    logprob_rows: Optional[int], require_host_lists: bool,
) -> None:
    """The gathered token counts of a DP-gather branch: replay fill, I1 on each count, I5 and I4."""
    host = rec.capture.host
    dp = layout.attn_dp_size if layout.require_mlp_tp_gather else 1
    v.expect_equal("padding", "gathered gpu shape", w, (dp,), rec.gpu_shape)
    # replay fill = bs * T in both gpu tensors
    v.expect_equal("fill", "global_num_tokens_gpu (replay fill)", w, [n] * dp, rec.global_num_tokens_gpu)
    v.expect_equal("fill", "global_num_tokens_for_logprob_gpu (replay fill)", w, [lp_rows] * dp, rec.global_num_tokens_for_logprob_gpu)
    # I1: capture = replay, for every gathered tensor and its host list
    cap = rec.capture
    v.expect_equal("I1", "global_num_tokens_gpu", w, rec.global_num_tokens_gpu, cap.global_num_tokens_gpu, "baked at capture vs replay fill")
    v.expect_equal(
        "I1", "global_num_tokens_for_logprob_gpu", w, rec.global_num_tokens_for_logprob_gpu, cap.global_num_tokens_for_logprob_gpu,
        "baked at capture vs replay fill",
    )
    host_nt, host_lp = host["global_num_tokens_cpu"], host["global_num_tokens_for_logprob_cpu"]
    if host_nt is not None or require_host_lists:
        v.expect_equal("I1", "global_num_tokens_cpu", w, rec.global_num_tokens_gpu, host_nt)
    else:
        host_nt = cap.global_num_tokens_gpu  # no host list: the graph holds the gpu value
    if host_lp is not None or require_host_lists:
        v.expect_equal("I1", "global_num_tokens_for_logprob_cpu", w, rec.global_num_tokens_for_logprob_gpu, host_lp)
    else:
        host_lp = cap.global_num_tokens_for_logprob_gpu
    lp, nt = host_lp or [], host_nt or []
    if logprob_rows is None:
        # I5: DRAFT_EXTEND_V2 is unpruned: for_logprob == num_tokens == bs * T, per rank
        v.expect_equal("I5", "global_num_tokens_for_logprob", w, list(nt), list(lp), "DRAFT_EXTEND_V2 emits logits for every token")
    else:
        v.expect_equal("I5", "global_num_tokens_for_logprob", w, [lp_rows] * dp, list(lp), f"pruned logits: lm_head sees {lp_rows} rows per rank")
        v.expect_equal("I5", "for_logprob <= num_tokens", w, True, len(lp) == len(nt) and all(a <= b for a, b in zip(lp, nt, strict=True)))
    v.expect_equal("I5", "global_num_tokens", w, [n] * dp, list(nt), "tokens, not requests: bs * num_tokens_per_bs")
    # I4 and the padding mode: buffer = Σ for_logprob = max * dp (MAX_LEN); pruned: the token buffer, Σ num_tokens
    if logprob_rows is None:
        v.expect_equal("I4", "global_dp_buffer_len", w, sum(lp), host["global_dp_buffer_len"], "Σ for_logprob = gathered rows")
    else:
        v.expect_equal("I4", "global_dp_buffer_len", w, sum(nt), host["global_dp_buffer_len"], "pruned logits: the DP buffer holds every token")
    if host["dp_padding_mode"] == "max_len" and nt:
        v.expect_equal("padding", "global_dp_buffer_len (MAX_LEN)", w, max(nt) * len(nt), host["global_dp_buffer_len"])


def check_replay_rows(v: Verdict, layout: ParallelLayout, rec: ReplayRecord, tp_rank: int, iteration: int, *, expected_rows: int) -> None:
    """I2 on one replayed record: rows fed to lm_head == this rank's for_logprob == logits rows produced.

    expected_rows: the logits rows the bucket must produce; bs * T for our runners (every
    DRAFT_EXTEND_V2 token), bs for a pruned-logits engine (`harness explain I2`). Shared by
    check_run_metadata and `harness engine-check`.
    """
    w = record_where(layout, rec, tp_rank, iteration)
    d = layout.attn_dp_rank(tp_rank)
    lp = rec.global_num_tokens_for_logprob_gpu
    per_token = f" ({rec.bs} x {rec.tokens_per_bs} tokens)" if expected_rows == rec.bs * rec.tokens_per_bs else ""
    rule = f"the {expected_rows} rows this bucket gives lm_head{per_token}"
    if lp is not None:
        own = lp[d if layout.require_mlp_tp_gather else 0]
        v.expect_agree("I2", None, w, {"global_num_tokens_for_logprob": own, "rows fed to lm_head": rec.rows_fed}, expected_rows, rule)
    v.expect_agree("I2", None, w, {"rows fed to lm_head": rec.rows_fed, "logits rows": rec.logits_rows}, expected_rows, rule)
    v.expect_equal("padding", "logits rows", w, expected_rows, rec.logits_rows)

