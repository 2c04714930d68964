"""Follow-up turns for the bench's replayed chat traffic, the user's side written by the target.

Consumer chat is multi-turn: each request resends the conversation so far, and the timed chat
set decodes third turns. The bundled persona prompts are first turns only, so a head trained
on them never sees a reply that follows earlier replies (the sign-off and opening hours a
persona repeats, a question that builds on the last answer). Writing follow-ups by hand would
give a few dozen; here the target plays the user instead: given the conversation rendered up
to the opening of a new user message, an instruction model continues it with a plausible
user message (the "pre-query template" trick Magpie, Xu et al. 2024, uses to synthesise
instruction data). That message is sampled (seeded per conversation, so the log is
reproducible), the target's reply to it is greedy, as the timed replies are.

Measured offline on the bench's own log (session 14): a head trained on half the log agreed
with the target's first token 0.303 of the time on held-out replies, on all of it 0.347, at
equal steps: the head is data-bound, and what it needs is more traffic of the timed kind.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.engine import Engine
from shared.sampling.params import SamplingParams
from shared.tokenizer import Tokenizer

Message = dict[str, str]
# Stands in for the new user message while the template renders, to find where it starts.
_MARK = "\x00user-message\x00"
# A user's message is short next to a reply; a sampled one that runs on is cut here.
USER_TOKENS = 48
USER_TEMPERATURE = 0.8


def user_opening(tokenizer: Tokenizer, history: Sequence[Message]) -> str:
    """The conversation rendered up to where a new user message's text begins."""
    text = tokenizer.apply_chat_template(
        [*history, {"role": "user", "content": _MARK}], add_generation_prompt=False
    )
    if _MARK not in text:
        raise ValueError("the chat template does not render a user message's text verbatim")
    return text[: text.index(_MARK)]


def follow_ups(
    engine: Engine,
    tokenizer: Tokenizer,
    histories: Sequence[Sequence[Message]],
    reply_tokens: int,
    seed: int = 0,
) -> list[tuple[list[Message], list[int], list[int]]]:
    """One more turn of each conversation (which must end with an assistant reply): the
    target writes the user's next message, then replies to it. Returns, per conversation
    whose simulated user said something, (the conversation with both new messages, the
    reply's prompt ids, the reply's ids)."""
    openings = [tokenizer.encode(user_opening(tokenizer, h)) for h in histories]
    sampled = [
        SamplingParams(temperature=USER_TEMPERATURE, max_tokens=USER_TOKENS, seed=seed + i)
        for i in range(len(histories))
    ]
    users = [message_text(tokenizer, ids) for ids in engine.generate(openings, sampled)]
    asked = [
        [*h, {"role": "user", "content": u}] for h, u in zip(histories, users, strict=True) if u
    ]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(h)) for h in asked]
    replies = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=reply_tokens))
    return [
        ([*h, {"role": "assistant", "content": message_text(tokenizer, r)}], p, r)
        for h, p, r in zip(asked, prompts, replies, strict=True)
    ]


def message_text(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """A generated message's text, as a client would resend it (no stop token, trimmed)."""
    return tokenizer.decode([t for t in ids if t not in tokenizer.stop_token_ids]).strip()
