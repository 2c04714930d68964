"""Speculative draft-and-verify decoding: draft sources, verification and adaptive choice."""
