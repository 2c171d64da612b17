"""specharness: a correctness harness for tensor-parallel speculative decoding."""

__version__ = "0.1.0"
