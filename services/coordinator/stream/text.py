"""Token ids to text, in one place: every backend (and so every worker and the engine)
streams token ids; the retry loop asks `text_changes` for each chunk's text delta, with the
request's one tracker, and ends the reply at a stop string.

A stop string ends the reply at the token that completed it: the chunk is cut there (token
ids, logprobs, counters) and marked finished with reason "stop"; the loop then closes the
backend's stream, which aborts the request on its replicas, so no step is spent on tokens
nobody will see. A backend's own "stop" usually ends on a stop token, whose text is not
shown; a structured output's grammar also ends the reply with "stop" on the token that
completes the value, which is shown (callers that know the stop tokens pass them).
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from services.coordinator.generation_backend import GenerationChunk
from services.coordinator.stream.text_tracker import TextTracker


def text_changes(
    chunk: GenerationChunk, tracker: TextTracker, stop_token_ids: Container[int] | None = None
) -> dict[str, Any]:
    """What the chunk's text makes of it, for the caller's one copy of the chunk: `text` (its
    delta), and where a stop string completes inside the chunk, the cut there.
    `stop_token_ids`: the tokens a backend's "stop" hides (None: its last token, whatever)."""
    ids = chunk.token_ids
    stop_token = (
        chunk.finished
        and chunk.finish_reason == "stop"
        and bool(ids)
        and (stop_token_ids is None or ids[-1] in stop_token_ids)
    )
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
                return {
                    "token_ids": ids[:n],
                    "logprobs": chunk.logprobs[:n],
                    "num_output_tokens": chunk.num_output_tokens - dropped,
                    "text": text,
                    "finished": True,
                    "finish_reason": "stop",
                }
    if chunk.finished:
        text += tracker.finish()
    return {"text": text}
