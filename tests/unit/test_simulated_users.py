"""The bench's simulated follow-up turns, on the real SmolLM2: the target writes the user's
next message (seeded), replies greedily, and each new turn's prompt resends the last one."""

from __future__ import annotations

import pytest

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from shared.sampling.params import SamplingParams
from tools.bench.simulated_users import follow_ups, user_opening

HISTORIES = [
    [
        {"role": "system", "content": "You are Pip, the bakery's cheerful assistant."},
        {"role": "user", "content": "Do you sell rye bread?"},
        {"role": "assistant", "content": "Yes, every morning from 7 am. Warm regards, Pip"},
    ],
    [
        {"role": "user", "content": "Give me a tip for packing light."},
        {"role": "assistant", "content": "Roll your clothes and bring one pair of shoes."},
    ],
]


@pytest.fixture(scope="module")
def engine(real_model, real_tokenizer, gguf_path):
    config = EngineConfig(model=str(gguf_path), weights="fp32", kv_cache_bytes=64 << 20)
    return Engine(config, model=real_model, tokenizer=real_tokenizer)


def test_the_user_opening_is_where_a_rendered_user_message_begins(real_tokenizer):
    opening = user_opening(real_tokenizer, HISTORIES[0])
    whole = real_tokenizer.apply_chat_template(
        [*HISTORIES[0], {"role": "user", "content": "And scones?"}], add_generation_prompt=False
    )
    assert whole.startswith(opening) and whole[len(opening) :].startswith("And scones?")
    assert opening.startswith(real_tokenizer.apply_chat_template(HISTORIES[0], False))


def test_a_follow_up_resends_the_conversation_and_its_reply_is_greedy(engine, real_tokenizer):
    turns = follow_ups(engine, real_tokenizer, HISTORIES, reply_tokens=8, seed=3)
    assert turns and len(turns) <= len(HISTORIES)
    for history, prompt, reply in turns:
        before, user, assistant = history[:-2], history[-2], history[-1]
        assert before in HISTORIES and user["role"] == "user" and user["content"].strip()
        assert assistant["role"] == "assistant"
        assert prompt == real_tokenizer.encode(real_tokenizer.apply_chat_template(history[:-1]))
        # The earlier turn's whole text is a prefix of the new prompt (head_train shares it).
        earlier = real_tokenizer.encode(real_tokenizer.apply_chat_template(before, False))
        assert prompt[: len(earlier)] == earlier
        greedy = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0]
        assert reply == greedy
    # Seeded: the same seed writes the same users, another seed other ones.
    again = follow_ups(engine, real_tokenizer, HISTORIES, reply_tokens=8, seed=3)
    assert [h for h, _, _ in again] == [h for h, _, _ in turns]
    other = follow_ups(engine, real_tokenizer, HISTORIES, reply_tokens=8, seed=11)
    assert [h[-2] for h, _, _ in other] != [h[-2] for h, _, _ in turns]


def test_a_template_that_drops_the_users_text_is_refused():
    class Dropping:
        def apply_chat_template(self, messages, add_generation_prompt=True):
            return "".join(m["role"] for m in messages)

    with pytest.raises(ValueError, match="does not render a user message's text verbatim"):
        user_opening(Dropping(), HISTORIES[0])  # type: ignore[arg-type]
