"""`splitserve up` for real: a coordinator, a prefill and a decode process on loopback, driven
with the official OpenAI SDK. The greedy reply through the disaggregated path equals the
engine's single-process greedy output."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from services.launcher import start_local_stack
from services.launcher.presets import loopback_config
from shared.config.schema import parse_config
from shared.modelfile.default import DEFAULT_MODEL_ID
from shared.sampling.params import SamplingParams

pytestmark = pytest.mark.real_model

QUESTION = "What is the capital of France? Answer in one sentence."


def stack_config(**pools) -> dict:
    return loopback_config(pools or None)


@pytest.fixture(scope="module")
def stack():
    with start_local_stack(parse_config(stack_config()), startup_timeout_s=240) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)


def expected_greedy(real_model, real_tokenizer, messages, max_tokens) -> tuple[str, int]:
    """(text, completion tokens) of the plain single-process engine."""
    # kv_cache_dtype auto resolves as the stack's workers resolve it (fp16 where the CPU
    # converts it): the plain run of the same configuration.
    config = EngineConfig(num_blocks=64, kv_cache_dtype="auto", num_threads=1)
    engine = Engine(config, model=real_model, tokenizer=real_tokenizer)
    prompt = real_tokenizer.encode(real_tokenizer.apply_chat_template(messages))
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    outputs = list(engine.run_until_done())
    ids = [t for o in outputs for t in o.new_token_ids]
    return real_tokenizer.decode(ids, skip_special_tokens=True), outputs[-1].num_output_tokens


def test_sdk_chat_greedy_equals_single_process(client, real_model, real_tokenizer):
    messages = [{"role": "user", "content": QUESTION}]
    expected, n_tokens = expected_greedy(real_model, real_tokenizer, messages, 24)
    resp = client.chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=messages, temperature=0, max_tokens=24
    )
    assert resp.choices[0].message.content == expected
    assert resp.choices[0].message.refusal is None
    prompt_len = len(real_tokenizer.encode(real_tokenizer.apply_chat_template(messages)))
    assert resp.usage.prompt_tokens == prompt_len
    assert resp.usage.completion_tokens == n_tokens
    assert "->" in resp.to_dict()["metadata"]["replica"]  # prefill->decode


def test_sdk_streaming_matches_and_reports_usage(client, real_model, real_tokenizer):
    # Not QUESTION: the decode replica holding that conversation would prefill it itself.
    messages = [{"role": "user", "content": "Name three rivers in Europe, in one short sentence."}]
    expected, n_tokens = expected_greedy(real_model, real_tokenizer, messages, 24)
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=messages,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, reasons, metadata = "", None, [], []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.to_dict().get("metadata"):
            metadata.append(chunk.to_dict()["metadata"])
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert text == expected
    assert usage is not None and usage.completion_tokens == n_tokens
    assert reasons and reasons[-1] in ("stop", "length")
    # The first token left before the KV push was over; the push's outcome comes at the end.
    assert "->" in metadata[-1]["replica"]  # prefill->decode
    assert "transfer" not in metadata[0]
    assert json.loads(metadata[-1]["transfer"])["status"] == "done"


def test_second_turn_reports_cached_tokens(client):
    first = [
        {"role": "system", "content": "You are a terse assistant. " * 8},
        {"role": "user", "content": "Name a colour."},
    ]
    r1 = client.chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=first, temperature=0, max_tokens=8
    )
    second = first + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "Another one."},
    ]
    r2 = client.chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=second, temperature=0, max_tokens=8
    )
    assert r2.usage.prompt_tokens_details.cached_tokens > 0


def test_bad_input_keeps_the_stack_healthy(stack, client):
    raw = httpx.post(
        f"{stack.base_url}/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=DEFAULT_MODEL_ID, messages=[{"role": "user", "content": "hi"}], temperature=-1
        )
    assert err.value.body["param"] == "temperature"
    ok = client.chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert ok.choices[0].message.content is not None


def test_echo_logprobs_agree_on_a_cached_prefix(stack, real_model, real_tokenizer):
    # The last request finds the prompt cached (the plain one in between reports the hit):
    # its prompt logprobs must still cover, and equal, every position.
    prompt = "Scoring a prompt twice: the second time its prefix is already in the cache. " * 4
    body = {
        "model": DEFAULT_MODEL_ID,
        "prompt": prompt,
        "max_tokens": 1,
        "logprobs": 1,
        "echo": True,
        "temperature": 0,
    }
    plain = {k: v for k, v in body.items() if k not in ("logprobs", "echo")}
    replies = [
        httpx.post(f"{stack.base_url}/completions", json=b, timeout=60) for b in (body, plain, body)
    ]
    assert [r.status_code for r in replies] == [200] * 3, [r.text for r in replies]
    assert replies[1].json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    cold, hot = (r.json()["choices"][0]["logprobs"] for r in (replies[0], replies[2]))
    ids = real_tokenizer.encode(prompt)
    assert cold["tokens"][: len(ids)] == hot["tokens"][: len(ids)]
    assert hot["token_logprobs"][0] is None and hot["top_logprobs"][0] is None
    assert hot["token_logprobs"][1:] == pytest.approx(cold["token_logprobs"][1:], abs=1e-4)
    assert all(isinstance(top, dict) and top for top in hot["top_logprobs"][1:])
    # The stack's KV dtype (auto: fp16 on CPUs that convert it) and its workers' one thread:
    # fp16 storage turns a last-bit difference of fp32 sums (another thread count sums in
    # another order) into a whole fp16 step, so the reference computes as the worker does.
    config = EngineConfig(num_blocks=64, kv_cache_dtype="auto", num_threads=1)
    engine = Engine(config, model=real_model, tokenizer=real_tokenizer)
    engine.add_request(ids, SamplingParams(max_tokens=1), prompt_logprobs=True)
    (first, *_) = list(engine.run_until_done())
    expected = [lp.logprob for lp in first.prompt_logprobs]
    assert hot["token_logprobs"][1 : len(ids)] == pytest.approx(expected, abs=1e-3)
