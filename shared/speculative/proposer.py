"""The interface every draft source implements.

A proposer guesses the next few tokens of a sequence; the target model verifies them in one
forward pass. Proposers never touch the target's KV cache: they only see token ids, so a
rejected guess costs the proposer nothing beyond an optional `rollback` of its own state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class DraftRequest:
    request_id: str
    # Prompt + output so far; the last token is not yet in the target's KV cache.
    token_ids: list[int]
    # Propose at most this many tokens (k for this sequence this step).
    max_tokens: int


@dataclass
class Draft:
    token_ids: list[int]
    # [len(token_ids), vocab] draft distribution q; None means a one-hot (greedy) proposal.
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.token_ids)


class DraftProposer(Protocol):
    name: str  # "ngram" | "draft"

    def propose(self, requests: list[DraftRequest], sampling: list[bool]) -> list[Draft]:
        """One draft per request; sampling[i] is True when request i samples at temperature > 0
        (model drafts must then return q so verification stays exact)."""
        ...

    def release(self, request_id: str) -> None:
        """The request ended: free any per-request state."""
        ...

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Tokens beyond position num_tokens of the sequence were rejected."""
        ...
