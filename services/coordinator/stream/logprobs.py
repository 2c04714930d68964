"""Token log-probabilities in the two shapes OpenAI uses (chat objects, legacy parallel lists)."""

from __future__ import annotations

from typing import Any

from shared.sampling.logprob import TokenLogprob
from shared.tokenizer.tokenizer import Tokenizer


def chat_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
    """`choices[].logprobs.content` entries: token text, its UTF-8 bytes, alternatives."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": tokenizer.decode([token_id]),
            "logprob": logprob,
            "bytes": list(tokenizer.token_bytes(token_id)),
        }

    return [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
        for lp in logprobs
    ]


class CompletionLogprobs:
    """Builds the legacy `{tokens, token_logprobs, top_logprobs, text_offset}` lists.

    `text_offset` counts characters from the start of the choice's text (the echoed prompt
    included), continuing across streamed chunks.
    """

    def __init__(self, tokenizer: Tokenizer, start_offset: int = 0):
        self.tokenizer = tokenizer
        self.offset = start_offset

    def prompt(
        self, token_ids: list[int], logprobs: list[TokenLogprob] | None
    ) -> dict[str, list[Any]]:
        """The prompt's lists: the first token has no context, so null logprob and null
        alternatives, as OpenAI reports it; every later one a value and a mapping."""
        rest = logprobs or []
        if len(rest) != len(token_ids) - 1 or any(
            lp.token_id != t for lp, t in zip(rest, token_ids[1:], strict=False)
        ):
            # A backend bug (the engine computes every prompt position it is asked for):
            # loud, with what would help find it, never a silently shifted list.
            raise ValueError(
                f"prompt logprobs cover {len(rest)} tokens of a {len(token_ids)}-token prompt "
                "(expected all but the first, in order)"
            )
        values: list[float | None] = [None, *(lp.logprob for lp in rest)]
        tops: list[dict[str, float] | None] = [
            None,
            *(self._top(lp.token_id, lp.logprob, lp.top) for lp in rest),
        ]
        return self._lists(token_ids, values, tops)

    def output(self, logprobs: list[TokenLogprob]) -> dict[str, list[Any]]:
        ids = [lp.token_id for lp in logprobs]
        values = [lp.logprob for lp in logprobs]
        tops = [self._top(lp.token_id, lp.logprob, lp.top) for lp in logprobs]
        return self._lists(ids, values, tops)

    def _top(
        self, token_id: int, logprob: float, alts: list[tuple[int, float]]
    ) -> dict[str, float]:
        top = {self.tokenizer.decode([t]): v for t, v in alts}
        # The chosen token is always listed, even when it was not among the top k.
        top.setdefault(self.tokenizer.decode([token_id]), logprob)
        return top

    def _lists(
        self, ids: list[int], values: list[float | None], tops: list[dict[str, float] | None]
    ) -> dict[str, list[Any]]:
        tokens = [self.tokenizer.decode([t]) for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def merge_completion_logprobs(*parts: dict[str, list[Any]]) -> dict[str, list[Any]]:
    merged: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for part in parts:
        for key, values in part.items():
            merged[key].extend(values)
    return merged
