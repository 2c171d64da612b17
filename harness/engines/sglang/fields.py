"""How I1 over every field (harness.props.p1_fields) classifies the fields of SGLang's replay views.

A replay of SGLang's draft runners hands the attention backend a view of the batch (`fb_view`, or the hook's
arguments in releases up to 0.5.12) built from the static buffers and the live batch; the graph bakes the forward
batch get_forward_batch(bs) built at capture. Each field the view carries is compared with the capture's; the ones
that legitimately differ are classified here with the release source that shows it (0.5.23's lines; the same code
in the releases before it, docs/engine-check.md "I1 over every field"), and the ones not yet settled are notes.
"""
from __future__ import annotations

from harness.props.p1_fields import OTHERS, Excluded, FieldPolicy, FieldRule, Noted

ML = "speculative/multi_layer_eagle_draft_extend_cuda_graph_runner.py"
SL = "speculative/eagle_draft_extend_cuda_graph_runner.py"
DD = "speculative/eagle_draft_cuda_graph_runner.py"

SGLANG_FIELDS: FieldPolicy = {
    "seq_lens_sum": FieldRule.BATCH,  # the live lanes' sum plus the padded lanes' fill
    "global_num_tokens_gpu": FieldRule.BUCKET,
    "global_num_tokens_for_logprob_gpu": FieldRule.BUCKET,
    # the replay view hands these buffers over whole (fb_view: req_pool_indices=buffers.req_pool_indices, seq_lens=
    # buffers.seq_lens; ML:512-513, SL:644-645); the backends read the first batch_size lanes
    "req_pool_indices": FieldRule.PREFIX,
    "seq_lens": FieldRule.PREFIX,
    "seq_lens_cpu": FieldRule.PREFIX,
    # set by the replay's prepare (ML:915, SL:628), never at capture: read by the plans the backends make out of the
    # graph at every replay (the triton backend's capture warm-up falls back to zeros on purpose); the in-graph
    # flash-attention path falls back to the spec info's num_tokens_per_req, the bucket's width, which is every
    # DRAFT_EXTEND_V2 lane's extent
    "spec_info.extend_seq_lens_tensor": Excluded(
        "an out-of-graph plan input, re-read at every replay; the in-graph path's fallback is the bucket's width",
        "layers/attention/triton_backend.py:715-724, layers/attention/flashattention_backend.py:3295-3310",
    ),
    "spec_info.positions": Noted(f"the capture sets None on purpose ({ML}:326), the replay the positions buffer ({ML}:914)"),
    # releases up to 0.5.12 hand the backend the live batch's spec info (0.5.7: spec_info=forward_batch.spec_info,
    # {ML}:515), later ones one the replay builds from the buffers ({ML}:904-915)
    "spec_info": Noted("the replay's spec info is the live batch's in releases up to 0.5.12"),
    "spec_info.*": Noted("the replay's spec info is the live batch's in releases up to 0.5.12"),
    # releases before 0.5.16 build the multi-layer replay's view from the live batch too (its input_ids, out_cache_loc,
    # ...): every field not named above is compared and a difference reported as a note until settled per release
    OTHERS: Noted("the replay's view carries the live batch's own value in the releases that build it from the live batch"),
}

# The single-layer draft-extend and the draft decode hand the backend the live batch's own spec info (and, the draft
# decode, every field of the live batch: SimpleNamespace(**vars(forward_batch), num_padding=...), DD:739): fields
# the scheduler set, not replay writes. Compared, and a difference reported as a note.
LIVE_VIEW = Noted(f"the replay's view carries the live batch's own value ({SL}:643-660, {DD}:739)")
_LIVE: FieldPolicy = {**SGLANG_FIELDS, OTHERS: LIVE_VIEW, "seq_lens_sum": FieldRule.BATCH,
                      "req_pool_indices": FieldRule.PREFIX, "seq_lens": FieldRule.PREFIX, "seq_lens_cpu": FieldRule.PREFIX}
RUNNER_FIELDS: dict[str, FieldPolicy] = {"single_layer": _LIVE, "draft_decode": _LIVE, "target_verify": _LIVE}


def sglang_field_policy(runner: str) -> FieldPolicy:
    return RUNNER_FIELDS.get(runner, SGLANG_FIELDS)
