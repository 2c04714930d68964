"""Pathological JSON bodies get a 400 in OpenAI's shape, and the keep-alive connection lives on.

A real uvicorn server (the connection is what is at stake, so no ASGI shortcut) in front of a
scripted backend. Every case goes over one httpx client and is followed on that same
connection by a normal request, which must succeed.
"""

from __future__ import annotations

import httpx
import pytest

from services.coordinator.api.app import create_app
from services.coordinator.api.http_body import MAX_JSON_DEPTH, nested_deeper_than
from services.coordinator.api.server import ServerThread
from services.coordinator.settings import APISettings
from tests.unit.scripted_backend import Script, ScriptedTestBackend

MODEL = "scripted"
DEEP = 20_000  # far past both our limit and the interpreter's recursion limit


def _nested_arrays(depth: int) -> str:
    return "[" * depth + "]" * depth


def _nested_objects(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def _chat(extra: str) -> bytes:
    """A chat body whose one message carries `extra` (raw JSON) as an extension field."""
    message = '{"role": "user", "content": "hi", "extra": ' + extra + "}"
    return ('{"model": "' + MODEL + '", "max_tokens": 2, "messages": [' + message + "]}").encode()


# (id, raw body): everything here must be a 400 invalid_json.
HOSTILE = [
    ("arrays_20000_deep", _nested_arrays(DEEP).encode()),
    ("objects_20000_deep_in_a_message", _chat(_nested_objects(DEEP))),
    ("arrays_20000_deep_in_a_message", _chat(_nested_arrays(DEEP))),
    # Parseable, but deeper than anything a request needs.
    ("objects_past_the_limit_in_a_message", _chat(_nested_objects(MAX_JSON_DEPTH + 1))),
    ("number_out_of_range", b'{"model": "scripted", "prompt": "hi", "temperature": 1e999}'),
]


@pytest.fixture(scope="module")
def server(real_tokenizer):
    backend = ScriptedTestBackend(real_tokenizer, {MODEL: Script(num_tokens=2)})
    with ServerThread(create_app(backend, APISettings(model_id=MODEL))) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        yield http


def _local_port(response: httpx.Response) -> int:
    """The client side's port: the same port means the same TCP connection."""
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def _normal_request(client: httpx.Client) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    return response


@pytest.mark.parametrize("body", [c[1] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_body_is_a_400_and_the_connection_stays_usable(client, body):
    headers = {"Content-Type": "application/json"}
    refused = client.post("/v1/chat/completions", content=body, headers=headers)
    assert refused.status_code == 400, refused.text[:500]
    assert refused.json() == {
        "error": {
            "message": refused.json()["error"]["message"],
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_json",
        }
    }
    assert refused.headers.get("connection") != "close"
    after = _normal_request(client)
    assert _local_port(after) == _local_port(refused)


def test_the_depth_refusal_names_the_limit(client):
    refused = client.post(
        "/v1/chat/completions",
        content=_chat(_nested_arrays(MAX_JSON_DEPTH)),
        headers={"Content-Type": "application/json"},
    )
    assert refused.status_code == 400
    assert f"more than {MAX_JSON_DEPTH} levels" in refused.json()["error"]["message"]


def test_nesting_within_the_limit_is_served(client):
    # body (1) > messages (2) > message (3) > extra: the deepest nesting still accepted.
    accepted = client.post(
        "/v1/chat/completions",
        content=_chat(_nested_arrays(MAX_JSON_DEPTH - 3)),
        headers={"Content-Type": "application/json"},
    )
    assert accepted.status_code == 200, accepted.text[:500]


def test_brackets_inside_strings_do_not_count(client):
    # Text full of brackets (code, say), with the escapes that could fool a scanner.
    content = '[[[[{{{{ \\" ]]]] \\\\ "[[' * 40
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    accepted = client.post("/v1/chat/completions", json=body)
    assert accepted.status_code == 200, accepted.text[:500]


@pytest.mark.parametrize(
    ("text", "deeper"),
    [
        ('{"a": [[1]]}', False),
        ('{"a": "[[[[[[", "b": "\\\\", "c": "\\"[[[["}', False),
        ('{"a": ' + "[" * 5 + "]" * 5 + "}", True),
        ('{"a": "\\u005b\\u005b\\u005b\\u005b\\u005b\\u005b"}', False),
    ],
)
def test_depth_is_measured_outside_strings(text, deeper):
    assert nested_deeper_than(text, 4) is deeper
