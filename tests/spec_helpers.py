"""Test draft sources for speculative decoding: an oracle that knows the target's continuation
(with planted mistakes, so every acceptance length occurs) and a proposer drawing from a fixed
distribution q that differs from the target's p."""

from __future__ import annotations

import torch

from shared.speculative.proposer import Draft, DraftRequest


class OracleProposer:
    """Proposes the known continuation of a prompt, corrupting every `wrong_every`-th token."""

    name = "draft"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], wrong_every: int = 3):
        self.continuations = continuations
        self.wrong_every = wrong_every
        self.calls = 0
        self.released: set[str] = set()

    def propose(self, requests: list[DraftRequest], sampling: list[bool]) -> list[Draft]:
        drafts = []
        for req in requests:
            self.calls += 1
            ids = self._continuation(req.token_ids)[: req.max_tokens]
            if self.wrong_every and ids and self.calls % self.wrong_every == 0:
                cut = self.calls % len(ids)
                ids = ids[:cut] + [(ids[cut] + 1) % 500]  # a wrong guess at position `cut`
            drafts.append(Draft(ids))
        return drafts

    def _continuation(self, tokens: list[int]) -> list[int]:
        for prompt, cont in self.continuations.items():
            n = len(prompt)
            done = len(tokens) - n
            if tuple(tokens[:n]) == prompt and tokens[n:] == cont[:done]:
                return cont[done:]
        return []

    def release(self, request_id: str) -> None:
        self.released.add(request_id)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        pass


class FixedQProposer:
    """Draws every draft token from one fixed distribution q over the vocabulary."""

    name = "draft"

    def __init__(self, q: torch.Tensor, seed: int = 7):
        self.q = q / q.sum()
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, requests: list[DraftRequest], sampling: list[bool]) -> list[Draft]:
        drafts = []
        for req in requests:
            k = req.max_tokens
            if k == 0:
                drafts.append(Draft([]))
                continue
            ids = torch.multinomial(self.q, k, replacement=True, generator=self.generator)
            drafts.append(Draft(ids.tolist(), self.q.expand(k, -1).clone()))
        return drafts

    def release(self, request_id: str) -> None:
        pass

    def rollback(self, request_id: str, num_tokens: int) -> None:
        pass
