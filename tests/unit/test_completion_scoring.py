"""`/v1/completions` as evaluation harnesses use it: `echo` + `logprobs` score a prompt.

lm-evaluation-harness (`local-completions`) scores a continuation by sending context +
continuation with `echo: true, logprobs: 1, max_tokens: 1` and reading `token_logprobs` and
`top_logprobs` from the context's end; the same context comes back for every choice of a
task, so its prefix is cached from the second request on. The values must not depend on
that (the engine computes every prompt position for such requests), and every prompt token
after the first needs its `top_logprobs` mapping (the harness takes its max).
"""

from __future__ import annotations

import httpx
import pytest

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from services.coordinator.api.app import create_app
from services.coordinator.api.server import ServerThread
from services.coordinator.settings import APISettings
from shared.modelfile.default import DEFAULT_MODEL_ID
from shared.sampling.params import SamplingParams
from tests.unit.coordinator_client import sse_events
from tools.inprocess.engine_backend import EngineBackend

pytestmark = pytest.mark.real_model

MODEL = DEFAULT_MODEL_ID
BLOCK = 16
CONTEXT = (
    "Goal: keep a cut apple from turning brown before the picnic starts.\n"
    "Which way is better? Think about what slows browning of fruit in the air.\nAnswer:"
)
CHOICES = [" Brush the slices with lemon juice.", " Leave the slices out in the sun."]


@pytest.fixture(scope="module")
def served(real_model, real_tokenizer):
    engine = Engine(EngineConfig(num_blocks=128, block_size=BLOCK), real_model, real_tokenizer)
    backend = EngineBackend(engine, model_id=MODEL).start()
    with ServerThread(create_app(backend, APISettings(model_id=MODEL))) as server:
        yield server, engine
    backend.close()


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[0].url, timeout=120) as http:
        yield http


def _score(http: httpx.Client, prompt, max_tokens: int = 1, logprobs: int = 1) -> dict:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "temperature": 0,
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "seed": 1234,
        "echo": True,
    }
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _loglikelihood(body: dict, ctxlens: list[int], generated: int) -> list[tuple[float, bool]]:
    """What the harness reads from a response: the continuation's summed logprob and whether
    each of its tokens was the most likely one."""
    out = []
    choices = sorted(body["choices"], key=lambda c: c["index"])
    for choice, ctxlen in zip(choices, ctxlens, strict=True):
        lp = choice["logprobs"]
        end = len(lp["token_logprobs"]) - generated
        values = lp["token_logprobs"][ctxlen:end]
        tops = lp["top_logprobs"][ctxlen:end]
        greedy = all(v == max(top.values()) for v, top in zip(values, tops, strict=True))
        out.append((sum(values), greedy))
    return out


def test_cached_and_uncached_prefix_give_the_same_prompt_logprobs(served, http, real_tokenizer):
    engine = served[1]
    prompt = CONTEXT + " Cold water"  # a prompt no other test sends: cold cache
    ids = real_tokenizer.encode(prompt)
    assert engine.blocks.match_prefix(ids).num_blocks == 0
    cold = _score(http, prompt, max_tokens=0, logprobs=2)["choices"][0]["logprobs"]
    assert engine.blocks.match_prefix(ids).num_blocks == len(ids) // BLOCK >= 2  # now cached
    hot_body = _score(http, prompt, max_tokens=0, logprobs=2)  # once failed with a 500
    hot = hot_body["choices"][0]["logprobs"]
    assert hot_body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # recomputed
    assert hot["tokens"] == cold["tokens"] == [real_tokenizer.decode([t]) for t in ids]
    assert hot["token_logprobs"][0] is None and hot["top_logprobs"][0] is None
    assert hot["token_logprobs"][1:] == pytest.approx(cold["token_logprobs"][1:], abs=1e-4)
    for value, top, old in zip(
        hot["token_logprobs"][1:], hot["top_logprobs"][1:], cold["top_logprobs"][1:], strict=True
    ):
        assert isinstance(top, dict) and 1 <= len(top) <= 3  # 2 alternatives + the token
        assert max(top.values()) >= value
        assert top.keys() == old.keys()
        assert list(top.values()) == pytest.approx(list(old.values()), abs=1e-4)


def test_lm_eval_loglikelihood_requests(served, http, real_model, real_tokenizer):
    context = real_tokenizer.encode(CONTEXT)
    continuations = [real_tokenizer.encode(c) for c in CHOICES]
    ctxlens = [len(context)] * len(CHOICES)
    # As the harness sends them: token ids, several prompts in one request, max_tokens 1.
    batched = _score(http, [context + c for c in continuations])
    assert [c["index"] for c in batched["choices"]] == [0, 1]
    by_ids = _loglikelihood(batched, ctxlens, generated=1)
    # One at a time, as text (tokenized_requests=False), and with max_tokens 0.
    by_text = [
        _loglikelihood(_score(http, CONTEXT + c), [len(context)], generated=1)[0] for c in CHOICES
    ]
    scored_only = [
        _loglikelihood(_score(http, [context + c], max_tokens=0), [len(context)], generated=0)[0]
        for c in continuations
    ]
    # The engine's own prompt logprobs for the same ids (a separate engine, cold cache).
    engine = Engine(EngineConfig(num_blocks=64, block_size=BLOCK), real_model, real_tokenizer)
    expected = []
    for c in continuations:
        engine.add_request(context + c, SamplingParams(max_tokens=1), prompt_logprobs=True)
        (first, *_) = list(engine.run_until_done())
        expected.append(sum(lp.logprob for lp in first.prompt_logprobs[len(context) - 1 :]))
    for got in (by_ids, by_text, scored_only):
        assert [s for s, _ in got] == pytest.approx(expected, abs=1e-3)
        assert all(isinstance(g, bool) for _, g in got)
    assert by_ids[0][0] != by_ids[1][0]  # two different continuations, two scores


def test_lm_eval_generate_until_request(http):
    body = {
        "prompt": "Question: What color is the sky on a clear day?\nAnswer:",
        "model": MODEL,
        "max_tokens": 16,
        "temperature": 0,
        "stop": ["\n\n", "Question:"],
        "seed": 1234,
    }
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert isinstance(choice["text"], str) and choice["finish_reason"] in ("stop", "length")
    assert "Question:" not in choice["text"]


def test_stream_null_means_not_streamed(http):
    response = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": None, "n": None},
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["usage"]["completion_tokens"] == 2


def test_streamed_echo_carries_the_prompt_logprobs_first(http, real_tokenizer):
    prompt = CONTEXT + CHOICES[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "logprobs": 1, "echo": True}
    whole = _score(http, prompt, max_tokens=3)["choices"][0]
    response = http.post("/v1/completions", json={**body, "temperature": 0, "stream": True})
    assert response.status_code == 200, response.text
    chunks = [e["choices"][0] for e in sse_events(response.text) if e["choices"]]
    first = chunks[0]
    n = len(real_tokenizer.encode(prompt))
    assert first["text"].startswith(prompt)
    assert first["logprobs"]["top_logprobs"][0] is None
    assert all(isinstance(t, dict) for t in first["logprobs"]["top_logprobs"][1:])
    streamed = [v for c in chunks for v in c["logprobs"]["token_logprobs"]]
    assert len(streamed) == n + 3
    assert streamed[1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=1e-4)
    assert "".join(c["text"] for c in chunks) == whole["text"]


def test_tokenizer_endpoints_as_the_harness_uses_them(http, real_tokenizer):
    # lm-eval's `tokenizer_backend=auto` uses the server's tokenizer when these answer.
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"]
    assert info["model_max_length"] > 0
    text = CONTEXT + CHOICES[0]
    tokens = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert tokens["tokens"] == real_tokenizer.encode(text) and tokens["count"] == len(
        tokens["tokens"]
    )
    back = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back == {"prompt": text}
    messages = [{"role": "user", "content": "Hi"}]
    chat = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    rendered = real_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert chat["tokens"] == real_tokenizer.encode(rendered)
    bad = http.post("/detokenize", json={"tokens": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    unknown = http.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    wrong = http.post("/tokenize", json={"prompt": 5})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "prompt"
