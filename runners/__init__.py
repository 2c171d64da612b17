"""The system under test: a small, faithful speculative-decoding engine.

`runners` knows nothing of `harness`; the harness drives it from outside.
"""
