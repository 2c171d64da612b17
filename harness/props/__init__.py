"""The properties, as plain functions returning a Verdict (DESIGN.md §4, §6.6), one module per property or part.

P1 metadata invariants: p1_records (one record's invariants, shared with engine-check),
p1_metadata (the fast path: every graph runner driven without a model), p1_run (what reached
lm_head). P3 eager vs graph (p3), P4 cross-layout against TP1 (p4); outputs holds the tensor
comparison P3 and P4 share. Over the speculative decoding loop: p2, p5_p6, p8, and spec_probes (their probes).
"""
