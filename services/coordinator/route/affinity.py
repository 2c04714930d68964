"""Which decode replica served a conversation last, so the next turn can go back to it.

Keyed by the request's `user` plus a hash of the prompt's leading block: every turn of a
chat resends the conversation, so turns of one conversation share that block while two
conversations of one user usually differ in it (system prompt aside, which is why the user
is part of the key). Bounded LRU: forgetting a conversation only costs the router a hint;
the KV index finds the replica too.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_CAPACITY = 10_000


class ConversationAffinity:
    def __init__(self, block_size: int, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.block_size = block_size
        self.capacity = capacity
        self._last: OrderedDict[tuple[str, int], str] = OrderedDict()

    def key(self, user: str | None, prompt_token_ids: list[int]) -> tuple[str, int] | None:
        # A prompt shorter than a block has no stable prefix to recognise the chat by.
        if not user or len(prompt_token_ids) < self.block_size:
            return None
        return (user, hash(tuple(prompt_token_ids[: self.block_size])))

    def previous(self, user: str | None, prompt_token_ids: list[int]) -> str | None:
        key = self.key(user, prompt_token_ids)
        if key is None or key not in self._last:
            return None
        self._last.move_to_end(key)
        return self._last[key]

    def remember(self, user: str | None, prompt_token_ids: list[int], worker_id: str) -> None:
        key = self.key(user, prompt_token_ids)
        if key is None:
            return
        self._last[key] = worker_id
        self._last.move_to_end(key)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)

    def __len__(self) -> int:
        return len(self._last)
