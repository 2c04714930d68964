"""What `splitserve bench spec` can measure (torch-free: the CLI parses against it)."""

from __future__ import annotations

# `head`: the draft head (shared/speculative/head_model.py) trained on the bench's own
# replayed chat traffic (services/bench/spec_head.py), served as a `draft`.
METHODS = ("none", "ngram", "draft", "adaptive", "head")
SETS = ("chat", "grounded")
# CPU minutes to train the bench's head: its replayed log (persona chats with two follow-up
# turns, editing requests; 838 turns) holds 222k tokens, 121k of them not resent, whose
# states took 13.9 of the 15 minutes the data may use (AVX2 EPYC, 2 threads; ~450 fp32
# steps followed). On an AVX-512 EPYC with bf16 arithmetic: states 9.9 minutes, then 1,468
# bf16 steps (416 against fp32's 691 ms a step), held-out first-guess agreement 0.456.
HEAD_MINUTES = 30.0
