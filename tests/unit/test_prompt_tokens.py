"""The coordinator's conversation-aware tokenizing: the same ids as encoding the whole prompt,
with each turn encoding only the pieces it adds."""

from __future__ import annotations

from services.coordinator.prepare.prompt_tokens import PromptTokens


def _chat(turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "You answer briefly.  Twice   spaced."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}: why is the sky blue?\n"})
        messages.append({"role": "assistant", "content": f" Because of Rayleigh {i} 🙂"})
    return messages


def test_ids_equal_the_whole_prompt_encoded_and_later_turns_reuse_pieces(real_tokenizer):
    prompts = PromptTokens(real_tokenizer)
    misses = []
    for turns in range(1, 6):
        text = real_tokenizer.apply_chat_template(_chat(turns), add_generation_prompt=True)
        assert prompts.encode(text) == real_tokenizer.encode(text)
        misses.append(prompts.misses)
    # After the first turn, a turn encodes only its new user and assistant messages (the
    # generation prompt and the end-of-turn pieces are already known).
    assert [b - a for a, b in zip(misses, misses[1:], strict=False)] == [2, 2, 2, 2]
    assert prompts.hits > prompts.misses


def test_text_without_control_tokens_and_odd_splits(real_tokenizer):
    prompts = PromptTokens(real_tokenizer)
    for text in ["plain text, no template", "<|im_start|>", "a<|im_end|><|im_end|>b", ""]:
        assert prompts.encode(text) == real_tokenizer.encode(text)


def test_memory_is_bounded_in_characters(real_tokenizer):
    prompts = PromptTokens(real_tokenizer, max_chars=100)
    for i in range(50):
        text = f"<|im_start|>user\nmessage number {i} with some words<|im_end|>\n"
        assert prompts.encode(text) == real_tokenizer.encode(text)
    assert prompts._chars <= 100
