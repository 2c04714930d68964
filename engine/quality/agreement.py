"""Top-1 agreement: how often a candidate build predicts the same next token as the baseline.

PIQA measures whether answers stay right; agreement measures whether the text a user would see
stays the same. The texts are a fixed, varied set (prose, instructions, chat turns in the
model's template, code), scored at every position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import torch

from engine.model.llama import LlamaModel
from engine.quality.forward import BranchedSequence, forward_hidden, head_logits, length_batches
from engine.quality.text_encoder import TextEncoder

AGREEMENT_FILE = "agreement_texts.txt"
TEXT_SEPARATOR = "%%"
# Each text is one sequence; a few per batch keeps the lm_head logits small.
BATCH_ROWS = 512


def load_agreement_texts(limit: int | None = None) -> list[str]:
    """The bundled texts, which are separated by lines holding only `%%`."""
    raw = resources.files("engine.quality").joinpath("data", AGREEMENT_FILE).read_text("utf-8")
    texts: list[str] = []
    current: list[str] = []
    for line in raw.splitlines():
        if line.strip() == TEXT_SEPARATOR:
            texts.append("\n".join(current).strip("\n"))
            current = []
        else:
            current.append(line)
    texts.append("\n".join(current).strip("\n"))
    texts = [t for t in texts if t]
    return texts if limit is None else texts[:limit]


@torch.inference_mode()
def top1_predictions(
    model: LlamaModel,
    encoder: TextEncoder,
    texts: Sequence[str],
    max_linear_rows: int | None = None,
) -> list[torch.Tensor]:
    """For each text, the argmax next token at every position ([len(tokens)] int64)."""
    seqs = [BranchedSequence(tuple(encoder.encode(text))) for text in texts]
    if any(not s.trunk for s in seqs):
        raise ValueError("an agreement text encoded to no tokens")
    out: list[torch.Tensor | None] = [None] * len(seqs)
    for batch in length_batches(seqs, BATCH_ROWS):
        hidden = forward_hidden(model, [seqs[i] for i in batch], max_linear_rows)
        for i, h in zip(batch, hidden, strict=True):
            out[i] = head_logits(model, h, max_linear_rows).argmax(-1)
    return [t for t in out if t is not None]


@dataclass(frozen=True)
class Agreement:
    matching: int
    positions: int

    @property
    def rate(self) -> float:
        return self.matching / self.positions if self.positions else 1.0


def top1_agreement(
    candidate: Sequence[torch.Tensor], baseline: Sequence[torch.Tensor]
) -> Agreement:
    """Pooled over all positions of all texts, so long texts weigh more, like tokens served."""
    if len(candidate) != len(baseline):
        raise ValueError(f"{len(candidate)} candidate texts vs {len(baseline)} baseline texts")
    matching = positions = 0
    for c, b in zip(candidate, baseline, strict=True):
        if c.shape != b.shape:
            raise ValueError(f"prediction lengths differ: {tuple(c.shape)} vs {tuple(b.shape)}")
        matching += int((c == b).sum())
        positions += int(b.numel())
    return Agreement(matching, positions)
