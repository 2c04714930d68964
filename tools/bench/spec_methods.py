"""What `splitserve bench spec` can measure (torch-free: the CLI parses against it)."""

from __future__ import annotations

# `head`: the draft head (engine/speculative/head_model.py) trained on the bench's own
# replayed chat traffic (tools/bench/spec_head.py), served as a `draft`.
METHODS = ("none", "ngram", "draft", "adaptive", "head")
SETS = ("chat", "grounded")
# CPU minutes to train the bench's head: its replayed log (persona chats with two follow-up
# turns, editing requests; 838 turns) holds 222k tokens, 121k of them not resent, whose
# states took 13.9 of the 15 minutes the data may use (AVX2 EPYC, 2 threads; ~450 fp32
# steps followed). On an AVX-512 EPYC with bf16 arithmetic: states 9.9 minutes, then 1,468
# bf16 steps (416 against fp32's 691 ms a step), held-out first-guess agreement 0.456.
# 45 (was 30; here ~9 go to the states, ~36 to training): the head overfits its log
# (first-guess agreement 0.82 on training chats against 0.47 held out, 30-minute head), yet
# held-out agreement still rises with steps. Same log, same states, training CPU-minutes
# after the states: 10 -> 0.426, 21 -> 0.467 (1,807 steps), 36 -> 0.475 (2,486 steps); the
# 36-minute head's chat b1 trees accept 2.55 tokens a verify step against the 21-minute
# head's 2.46. Measured at 10 minutes and not kept: input-state noise 0.2 (0.426), dropout
# 0.1 on the fused input (0.412), the target's MLP frozen (0.420), weight decay 0.1
# (0.428); half the training chats gave 0.405, so a longer log would help too.
HEAD_MINUTES = 45.0
