"""The properties: one module per property, each defining its `Property` (harness.props.base), which the registry
(harness.props.registry) finds. `harness explain ID` and the docs list them from the registry.

P1 metadata invariants (p1; the no-model drive in p1_metadata, one record's rules in p1_records, shared with
engine-check, and those of vLLM's shapes in p1_shapes), P2 padded lanes (p2; the loop's instruments in poison), P3
eager vs graph (p3), P4 cross-layout (p4), P5 lossless (p5; the logprobs' checks in logprobs) and P6 acceptance (p6;
its comparison with the acceptance golden in p6_acceptance, the draft probes in draft_probes) over the loop (loop_run,
with the verify shadows of verify_shadow), P7 uneven DP load (p7; the collective checks, in the loop too, in
collectives), P8 batch churn (p8), simulated vs real ranks (sim_vs_real); draft_decode holds the draft decode's
checks, outputs the tensor comparison P3 and P4 share, tolerances every bound with its reason.

This package's own __init__ imports nothing: harness.props.p1_records is read by engine-check without the rest.
"""
