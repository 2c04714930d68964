"""Token ids to text, in one place: every backend streams token ids, and this stage turns a
request's chunks into text deltas and ends the stream at a stop string.

A stop string ends the reply at the token that completed it: the chunk is cut there (token
ids, logprobs, counters), marked finished with reason "stop", and the backend's iterator is
closed, which aborts the request on its replicas so that no step is spent on tokens nobody
will see. A backend's own "stop" is a stop token: it ends the reply and its text is not shown.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from services.coordinator.backend import GenerationChunk
from shared.tokenizer.detokenizer import IncrementalDetokenizer
from shared.tokenizer.text_tracker import TextTracker
from shared.tokenizer.tokenizer import Tokenizer


async def with_text(
    chunks: AsyncIterator[GenerationChunk], tokenizer: Tokenizer, stop: tuple[str, ...]
) -> AsyncIterator[GenerationChunk]:
    """`chunks` with `text` set; the last one yielded is finished (by the backend or here)."""
    tracker = TextTracker(IncrementalDetokenizer(tokenizer), stop)
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        async for chunk in chunks:
            add_text(chunk, tracker)
            yield chunk
            if chunk.finished:
                return  # closing `chunks` before its end aborts the request (stop string)


def add_text(chunk: GenerationChunk, tracker: TextTracker) -> None:
    """Sets `chunk.text`; cuts the chunk at the token that completes a stop string."""
    ids = chunk.token_ids
    stop_token = chunk.finished and chunk.finish_reason == "stop" and bool(ids)
    shown = ids[:-1] if stop_token else ids
    if tracker.matcher is None:
        text = tracker.feed(shown)[0] if shown else ""
    else:
        text = ""
        # One token at a time: a stop string completed inside a multi-token chunk (accepted
        # speculative drafts) ends the reply exactly where plain decoding would.
        for n, token in enumerate(shown, 1):
            delta, hit = tracker.feed([token])
            text += delta
            if hit:
                dropped = len(ids) - n
                if dropped:
                    chunk.token_ids = ids[:n]
                    chunk.logprobs = chunk.logprobs[:n]
                    chunk.num_output_tokens -= dropped
                chunk.text, chunk.finished, chunk.finish_reason = text, True, "stop"
                return
    if chunk.finished:
        text += tracker.finish()
    chunk.text = text
