"""What `splitserve bench spec` can measure (torch-free: the CLI parses against it)."""

from __future__ import annotations

# `head`: the draft head (shared/speculative/head_model.py) trained on the bench's own
# replayed chat traffic (services/bench/spec_head.py), served as a `draft`.
METHODS = ("none", "ngram", "draft", "adaptive", "head")
SETS = ("chat", "grounded")
# CPU minutes to train the bench's head: its replayed log (persona chats with two follow-up
# turns, editing requests) holds about 133k tokens whose states take about half of it.
HEAD_MINUTES = 30.0
