"""The OpenAI surface over a real in-process engine, driven by the official `openai` SDK.

One server (uvicorn on a free loopback port) serves the real SmolLM2 through `EngineBackend`
for the whole module; a second, separate `Engine` computes what the model says for the same
prompts, so the HTTP layer is held to the engine's own output.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from prometheus_client.parser import text_string_to_metric_families

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from services.coordinator.api.app import create_app
from services.coordinator.api.server import ServerThread
from services.coordinator.settings import APISettings
from shared.modelfile.default import DEFAULT_MODEL_ID
from shared.sampling.params import SamplingParams
from tools.inprocess.engine_backend import EngineBackend

pytestmark = pytest.mark.real_model

MODEL = DEFAULT_MODEL_ID
BLOCK = 16
FIRST = [{"role": "user", "content": "What is the capital of France?"}]
# Given as text parts, which the template joins like a plain string.
SECOND = [{"role": "user", "content": [{"type": "text", "text": "Name three primary colors."}]}]


def _prompt_ids(tokenizer, messages) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


@pytest.fixture(scope="module")
def expected(real_model, real_tokenizer):
    """Greedy replies (text, token count, ids) from a separate engine, in the order served."""
    engine = Engine(EngineConfig(num_blocks=64, block_size=BLOCK), real_model, real_tokenizer)
    replies = []
    for messages in (FIRST, SECOND):
        engine.add_request(
            _prompt_ids(real_tokenizer, messages), SamplingParams(temperature=0.0, max_tokens=16)
        )
        outs = list(engine.run_until_done())
        ids = [t for o in outs for t in o.new_token_ids]
        text = real_tokenizer.decode(ids, skip_special_tokens=True)  # <|im_end|> not shown
        replies.append((text, outs[-1].num_output_tokens, ids))
    return replies


@pytest.fixture(scope="module")
def served(real_model, real_tokenizer, expected):
    engine = Engine(EngineConfig(num_blocks=128, block_size=BLOCK), real_model, real_tokenizer)
    backend = EngineBackend(engine, model_id=MODEL).start()
    with ServerThread(create_app(backend, APISettings(model_id=MODEL))) as server:
        yield server, engine, backend
    backend.close()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0].url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[0].url, timeout=60) as http:
        yield http


def _sse_payloads(lines) -> list[dict | str]:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_chat_non_streaming_matches_engine(client, real_tokenizer, expected):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=FIRST, temperature=0, max_tokens=16, service_tier="priority"
    )
    body = raw.http_response.json()
    ChatCompletion.model_validate(body)  # the SDK's own schema, strictly
    reply = raw.parse()
    text, num_tokens, _ = expected[0]
    assert reply.choices[0].message.content == text
    assert (
        "refusal" in body["choices"][0]["message"]
        and body["choices"][0]["message"]["refusal"] is None
    )
    assert reply.choices[0].finish_reason == "stop"
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert reply.service_tier == "priority"
    assert reply.system_fingerprint and reply.created > 0
    usage = reply.usage
    assert usage.prompt_tokens == len(_prompt_ids(real_tokenizer, FIRST))
    assert usage.completion_tokens == num_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0  # a fresh engine
    metadata = body["metadata"]
    assert {k: metadata[k] for k in ("request_id", "replica", "service_tier")} == {
        "request_id": reply.id,
        "replica": "local",
        "service_tier": "priority",
    }
    # Values are strings (OpenAI's metadata map); structured ones are JSON.
    assert all(isinstance(v, str) for v in metadata.values())
    (attempt,) = json.loads(metadata["attempts"])
    assert attempt["model"] == MODEL and attempt["success"] is True
    cost = json.loads(metadata["cost"])
    assert cost["tier"] == "priority" and cost["total_usd"] > 0
    assert raw.http_response.headers["x-request-id"] == reply.id


def test_chat_streaming_matches_engine(client, expected):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=SECOND,
        temperature=0,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.to_dict())
    text, num_tokens, _ = expected[1]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.id for c in chunks} == {chunks[0].id}
    content = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(content) == text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "stop" and set(reasons[:-1]) == {None}
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == num_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_second_turn_reuses_the_cached_conversation(client, real_tokenizer, expected):
    turn2 = [
        *FIRST,
        {"role": "assistant", "content": expected[0][0]},
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": "And of Germany?"},
    ]
    reply = client.chat.completions.create(
        model=MODEL, messages=turn2, temperature=0, max_completion_tokens=4
    )
    first_turn_blocks = len(_prompt_ids(real_tokenizer, FIRST)) // BLOCK * BLOCK
    assert reply.usage.prompt_tokens_details.cached_tokens >= first_turn_blocks > 0
    as_system = [{**m, "role": "system"} if m["role"] == "developer" else m for m in turn2]
    assert reply.usage.prompt_tokens == len(_prompt_ids(real_tokenizer, as_system))
    assert reply.usage.completion_tokens <= 4


def test_chat_logprobs(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=FIRST, temperature=0, max_tokens=3, logprobs=True, top_logprobs=2
    )
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens == 3
    assert "".join(e.token for e in entries) == reply.choices[0].message.content
    for entry in entries:
        assert len(entry.top_logprobs) == 2
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert bytes(entry.bytes).decode() == entry.token


def test_stop_string_and_seeded_sampling(served, client, expected, real_tokenizer):
    _, engine, _ = served
    aborted = engine.num_aborted
    reply = client.chat.completions.create(
        model=MODEL, messages=FIRST, temperature=0, max_tokens=16, stop=[" Paris"]
    )
    text, num_tokens, ids = expected[0]
    assert " Paris" in text  # else this checks nothing
    assert reply.choices[0].message.content == text.split(" Paris")[0]
    assert reply.choices[0].finish_reason == "stop"
    # The coordinator matched the stop string and aborted the rest on the engine: the tokens
    # counted are those up to the one that completed " Paris", and nothing runs on.
    head = text[: text.index(" Paris") + len(" Paris")]
    assert reply.usage.completion_tokens < num_tokens
    reached = next(
        n
        for n in range(1, len(ids) + 1)
        if head in real_tokenizer.decode(ids[:n], skip_special_tokens=True)
    )
    assert reply.usage.completion_tokens == reached
    deadline = time.monotonic() + 5
    while engine.has_work and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.num_aborted == aborted + 1 and not engine.sequences
    engine.blocks.check_integrity()
    sampled = [
        client.completions.create(
            model=MODEL, prompt="My favourite animal is", max_tokens=4, temperature=1.0, seed=7
        ).choices[0]
        for _ in range(2)
    ]
    assert sampled[0].text == sampled[1].text


def test_concurrent_requests_are_batched_and_kept_apart(served):
    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=f"{served[0].url}/v1", api_key="unused", max_retries=0)
        async with client:
            calls = [
                client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"Count to {n}."}],
                    max_tokens=4,
                    temperature=0,
                    service_tier=tier,
                    extra_body={"ignore_eos": True},
                )
                for n, tier in ((3, "priority"), (5, "flex"), (7, "batch"))
            ]
            return await asyncio.gather(*calls)

    replies = asyncio.run(run())
    assert len({r.id for r in replies}) == 3
    assert [r.service_tier for r in replies] == ["priority", "flex", "batch"]
    assert all(r.usage.completion_tokens == 4 for r in replies)
    assert not served[1].has_work


def test_completion_echo_scores_the_prompt(client, real_tokenizer):
    prompt = "The capital of France is Paris"
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    body = raw.http_response.json()
    choice = body["choices"][0]
    ids = real_tokenizer.encode(prompt)
    assert choice["text"] == prompt
    lp = choice["logprobs"]
    assert lp["tokens"] == [real_tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None
    assert len(lp["token_logprobs"]) == len(ids)
    assert all(v <= 0.0 for v in lp["token_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"][-1] == prompt.rindex(" Paris")
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_completion_prompts_as_token_ids_and_batches(client, real_tokenizer):
    ids = real_tokenizer.encode("Once upon a time")
    reply = client.completions.create(
        model=MODEL,
        prompt=[ids, ids[:2]],
        max_tokens=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    Completion.model_validate(reply.to_dict())
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert reply.usage.prompt_tokens == len(ids) + 2
    assert reply.usage.completion_tokens == 4
    assert reply.id.startswith("cmpl-") and reply.object == "text_completion"


def test_continuous_usage_stats_on_every_chunk(http):
    body = {
        "model": MODEL,
        "prompt": "One, two, three,",
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = _sse_payloads(response.iter_lines())
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 3
    assert chunks[-1]["choices"] == []
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


DISCONNECTED = (("endpoint", "chat"), ("model", MODEL), ("status", "499"), ("tier", "default"))


def test_client_disconnect_aborts_the_request(served, http):
    _, engine, backend = served
    aborted_before = engine.num_aborted
    closed_before = _metrics(http).get(("splitserve_requests_total", DISCONNECTED), 0)
    body = {
        "model": MODEL,
        "messages": FIRST,
        "max_tokens": 200,  # far more than the test waits for: only an abort ends it early
        "ignore_eos": True,
        "stream": True,
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"role"' not in line:
                break  # one token arrived; leaving the block drops the connection
    deadline = time.monotonic() + 10
    while engine.has_work or engine.num_aborted == aborted_before:
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert engine.num_aborted == aborted_before + 1
    assert not engine.has_work and not engine.sequences
    engine.blocks.check_integrity()
    assert _metrics(http)[("splitserve_requests_total", DISCONNECTED)] == closed_before + 1


def test_non_streaming_client_that_gives_up_frees_the_engine(served, http):
    engine = served[1]
    closed_before = _metrics(http).get(("splitserve_requests_total", DISCONNECTED), 0)
    body = {"model": MODEL, "messages": FIRST, "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    deadline = time.monotonic() + 10
    while engine.has_work and time.monotonic() < deadline:
        time.sleep(0.02)
    # 500 tokens take far longer than this: the request was dropped, not run to the end.
    assert not engine.has_work and not engine.sequences
    assert _metrics(http)[("splitserve_requests_total", DISCONNECTED)] == closed_before + 1


def _metrics(http) -> dict[tuple, float]:
    response = http.get("/metrics")
    assert response.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def test_metrics_count_a_request(client, http):
    before = _metrics(http)
    reply = client.chat.completions.create(
        model=MODEL, messages=FIRST, temperature=0, max_tokens=3, service_tier="flex"
    )
    after = _metrics(http)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"model": MODEL, "tier": "flex", **labels}.items())))
        return after[key] - before.get(key, 0)

    assert delta("splitserve_requests_total", endpoint="chat", status="200") == 1
    assert delta("splitserve_time_to_first_token_seconds_count") == 1
    assert delta("splitserve_e2e_request_latency_seconds_count") == 1
    assert delta("splitserve_inter_token_latency_seconds_count") == 2  # 3 tokens, 2 gaps
    usage = reply.usage
    assert delta("splitserve_prompt_tokens_total") == usage.prompt_tokens
    assert delta("splitserve_cached_prompt_tokens_total") == (
        usage.prompt_tokens_details.cached_tokens
    )
    assert delta("splitserve_completion_tokens_total") == usage.completion_tokens == 3


def test_models_health_and_ready(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert http.get("/health").json() == {"status": "ok"}
    ready = http.get("/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True
