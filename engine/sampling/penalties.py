"""Repetition, frequency and presence penalties applied to raw logits.

Repetition penalty (CTRL-style) pushes every token already seen in the prompt or output
towards zero logit: positive logits are divided by the penalty, negative ones multiplied,
so a penalty above 1 always makes a seen token less likely whatever its sign. Frequency and
presence penalties (OpenAI-style) count only generated tokens and subtract
``frequency * count + presence * (count > 0)``.
"""

from __future__ import annotations

import torch

from engine.sampling.batch import SamplingBatch


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Return penalised ``[B, V]`` logits; the input is left untouched."""
    vocab = logits.shape[-1]
    if batch.repetition is not None:
        seen = batch.repetition.seen.counts(vocab, logits.dtype) > 0
        penalty = batch.repetition.penalty.to(logits.dtype).unsqueeze(-1)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if batch.counts is not None:
        counts = batch.counts.output.counts(vocab, logits.dtype)
        frequency = batch.counts.frequency.to(logits.dtype).unsqueeze(-1)
        presence = batch.counts.presence.to(logits.dtype).unsqueeze(-1)
        logits = logits - frequency * counts - presence * (counts > 0).to(logits.dtype)
    return logits
