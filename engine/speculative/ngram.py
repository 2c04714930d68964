"""Prompt lookup: propose the tokens that followed the last occurrence of the current suffix.

Grounded work (summarise, edit, rewrite) copies spans of its input, and chat repeats names and
phrases, so "what came after these n tokens last time" is often exactly what comes next. The
proposal costs no model call. Each request keeps a dict from every n-gram (n in
[min_n, max_n]) to the end position of its latest occurrence, extended only by the tokens
added since the last call: a step costs O(new tokens x n sizes), never a rescan of the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.speculative.proposer import Draft, DraftRequest


@dataclass
class _Index:
    tokens: list[int] = field(default_factory=list)
    # n-gram -> position of its last token, for n-grams ending before the newest token (so the
    # lookup of the current suffix finds an earlier occurrence, never itself).
    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed_upto: int = 0  # n-grams ending at positions < indexed_upto are in last_end


class NgramProposer:
    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes need 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self._indexes: dict[str, _Index] = {}
        # Length of the suffix the last proposal matched, per request: longer matches are
        # accepted more often, so the adaptive controller tracks acceptance per length.
        self.match_length: dict[str, int] = {}

    def propose(self, requests: list[DraftRequest], sampling: list[bool]) -> list[Draft]:
        return [self._propose_one(r) for r in requests]

    def release(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
        self.match_length.pop(request_id, None)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        index = self._indexes.get(request_id)
        if index is not None and num_tokens < len(index.tokens):
            # Rare (the engine only feeds accepted tokens): rebuilding is simpler than undoing.
            self._indexes[request_id] = _Index()

    def _propose_one(self, request: DraftRequest) -> Draft:
        tokens = request.token_ids
        if request.max_tokens <= 0 or len(tokens) < 2:
            return Draft([])
        index = self._sync(request.request_id, tokens)
        end = len(tokens) - 1
        self.match_length[request.request_id] = 0
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            found = index.last_end.get(tuple(tokens[end - n + 1 : end + 1]))
            if found is not None:
                self.match_length[request.request_id] = n
                return Draft(tokens[found + 1 : found + 1 + request.max_tokens])
        return Draft([])

    def _sync(self, request_id: str, tokens: list[int]) -> _Index:
        index = self._indexes.get(request_id)
        known = 0 if index is None else len(index.tokens)
        if (
            index is None
            or known > len(tokens)
            or (known and index.tokens[-1] != tokens[known - 1])
        ):
            index = self._indexes[request_id] = _Index()
            known = 0
        index.tokens.extend(tokens[known:])
        last_end = index.last_end
        for end in range(index.indexed_upto, len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                last_end[tuple(tokens[end - n + 1 : end + 1])] = end
        index.indexed_upto = max(index.indexed_upto, len(tokens) - 1)
        return index
