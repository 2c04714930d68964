"""The interface every draft source implements.

A proposer guesses the next few tokens of a sequence; the target model verifies them in one
forward pass. Proposers never touch the target's KV cache: they only see token ids, so a
rejected guess costs the proposer nothing beyond an optional `rollback` of its own state.

A draft is a chain (each guess follows the one before) or, for greedy rows, a tree: several
candidate continuations sharing their common prefixes, verified together in one pass with a
tree attention mask (engine/speculative/tree.py). Nodes are listed parents first, so the
first n nodes of any draft are themselves a valid draft.
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
    # Tree drafts: the node each token follows (-1: the sequence's last token), every parent
    # listed before its children. None: a chain (token i follows token i - 1).
    parents: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.parents is None:
            return
        if len(self.parents) != len(self.token_ids):
            raise ValueError("a tree draft needs one parent per token")
        if any(not -1 <= p < i for i, p in enumerate(self.parents)):
            raise ValueError(f"tree parents must precede their children: {self.parents}")
        if self.probs is not None and self.is_tree:
            # Exact acceptance of several sampled candidates at one position would need
            # multi-draft rejection sampling; sampled rows draft chains.
            raise ValueError("a sampled draft (with q) must be a chain, not a tree")
        if not self.is_tree:
            self.parents = None  # a tree that is a chain is stored as one

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None and any(p != i - 1 for i, p in enumerate(self.parents))

    def prefix(self, n: int) -> Draft:
        """The first n nodes: a chain's first n guesses, or a tree cut to n nodes (parents
        come first, so what is kept is still a tree)."""
        if n >= len(self.token_ids):
            return self
        probs = self.probs[:n] if self.probs is not None else None
        parents = self.parents[:n] if self.parents is not None else None
        return Draft(self.token_ids[:n], probs, parents)


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
