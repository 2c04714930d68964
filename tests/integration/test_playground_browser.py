"""The playground in a real headless browser (Debian's chromium, driven by Playwright) against a
real local stack on the bundled model, with API keys configured and traces to a file.

Without a key the page says so and calls nothing but its own config; a wrong key shows the
API's 401; with the right one a typed message streams in with the text of the API's greedy
reply, its TTFT and tokens, and a second turn shows cached tokens; the tier picker changes
the tier label; a saved router with a fallback lists its attempts; Stop cancels the request
on the workers (their free blocks return); the fleet view lists every worker; the waterfall
reaches the workers' spans. A screenshot of each view goes to test-artifacts/playground/.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from services.launcher import start_local_stack
from shared.config.schema import parse_config
from shared.modelfile.default import DEFAULT_MODEL_ID
from shared.proto_gen import worker_pb2 as pb
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from tests.integration.test_local_stack import stack_config

pytestmark = pytest.mark.real_model

KEY = "sk-playground-browser-test"
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "playground"
ROUTER = "router/fallback"
SETTLE_S = 5.0  # well under the transfer deadline: only an active cancel frees blocks this fast
WAIT_MS = 60_000


def _playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (make install installs it)")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no browser at {CHROMIUM}: `make browser` installs Debian's chromium")
    return sync_playwright


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("playground-stack")
    config = {
        **stack_config(),
        "telemetry": {"exporter": "file", "file": str(run_dir / "traces.jsonl")},
        "api_keys": {"keys": [{"name": "playground", "key": KEY}]},
        # The first model always misses a 1 ms first-token deadline: the second one answers.
        "routers": {
            "fallback": {"models": [DEFAULT_MODEL_ID] * 2, "fallback": {"ttft_timeout": 1}}
        },
    }
    with start_local_stack(parse_config(config), 240, run_dir=run_dir / "run") as running:
        yield running


@pytest.fixture(scope="module")
def page(stack):
    sync_playwright = _playwright()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        page.requests_seen = []
        page.on("request", lambda r: page.requests_seen.append(r.url))
        page.console_errors = []
        page.on("pageerror", lambda exc: page.console_errors.append(str(exc)))
        yield page
        browser.close()


def shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def api_greedy(stack, messages: list[dict], max_tokens: int) -> str:
    body = {"model": DEFAULT_MODEL_ID, "messages": messages, "max_tokens": max_tokens}
    resp = httpx.post(
        f"{stack.base_url}/chat/completions",
        json={**body, "temperature": 0},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


def send(page, text: str, prefix: str = "") -> object:
    """Type `text` into a composer and press Enter; the new assistant reply's locator."""
    replies = page.locator(f"{prefix} .message.assistant")
    before = replies.count()
    page.locator("#prompt" if not prefix else "#compare-prompt").fill(text)
    page.locator("#prompt" if not prefix else "#compare-prompt").press("Enter")
    reply = replies.nth(before)
    reply.wait_for()
    return reply


def until(condition, what, timeout_s: float = WAIT_MS / 1000) -> None:
    """Polls from here: the page's CSP forbids the string evaluation `wait_for_function`
    polls with, as it should. `what`: a description, or a callable that makes one."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, (
            f"timed out waiting for {what() if callable(what) else what}"
        )
        time.sleep(0.05)


def finished(reply) -> None:
    reply.locator(".figures").wait_for()


def figure(reply, name: str) -> str:
    return reply.locator(f'[data-figure="{name}"]').inner_text()


def test_without_a_key_the_page_asks_and_calls_nothing_else(stack, page):
    page.goto(f"{stack.url}/")
    page.locator("#auth").wait_for(state="visible")
    assert "needs an API key" in page.locator("#auth-message").inner_text()
    page.wait_for_timeout(300)  # time for any stray call to show up
    paths = [urlparse(u).path for u in page.requests_seen]
    assert "/playground/api/config" in paths
    others = [p for p in paths if p != "/" and not p.startswith("/playground/")]
    assert others == [], others  # no /v1 call, nothing else
    assert not [
        p for p in paths if p.startswith("/playground/api/") and p != "/playground/api/config"
    ]
    shot(page, "auth-needed")


def test_a_wrong_key_shows_the_apis_401(stack, page):
    page.locator("#api-key").fill("sk-not-the-key")
    page.locator("#api-key").press("Enter")
    message = page.locator("#auth-message")
    until(lambda: "401" in message.inner_text(), "the 401")
    assert "401: Incorrect API key provided." in message.inner_text()
    shot(page, "auth-wrong-key")
    page.locator("#api-key").fill(KEY)
    page.locator("#api-key-save").click()
    page.locator("#auth").wait_for(state="hidden")
    models = page.locator("#model option").all_inner_texts()
    assert models == [DEFAULT_MODEL_ID, ROUTER]
    assert page.evaluate("sessionStorage.getItem('splitserve.apiKey')") == KEY


def test_a_reply_streams_in_with_the_greedy_text_and_its_figures(stack, page):
    page.locator("#temperature").fill("0")
    page.locator("#max-tokens").fill("24")
    page.locator("#system-prompt").fill("You are a concise assistant.")
    question = "What is the capital of France? Answer in one sentence."
    reply = send(page, question)
    # Streaming: the item exists (and grows) before the reply's figures do.
    reply.locator(".text").wait_for()
    finished(reply)
    history = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": question},
    ]
    expected = api_greedy(stack, history, 24)
    assert reply.locator(".text").text_content() == expected
    assert figure(reply, "ttft").endswith(" ms") and float(figure(reply, "ttft").split()[0]) > 0
    completion = int(figure(reply, "completion-tokens"))
    assert 0 < completion <= 24
    assert int(figure(reply, "prompt-tokens")) > 10
    assert figure(reply, "cost").startswith("$")
    assert figure(reply, "replica") != "–"
    # One bar per gap between text arrivals (a chunk may carry more than one token).
    assert 1 <= reply.locator(".itl-chart rect").count() <= completion - 1
    assert reply.locator(".routing li").count() >= 1

    second = send(page, "And of Italy?")
    finished(second)
    cached = figure(second, "cached-tokens")
    assert int(cached.split()[0]) > 0, cached
    history += [
        {"role": "assistant", "content": expected},
        {"role": "user", "content": "And of Italy?"},
    ]
    assert second.locator(".text").text_content() == api_greedy(stack, history, 24)
    reply.locator("details.raw summary").click()
    raw = json.loads(reply.locator("details.raw pre").inner_text())
    assert raw["usage"]["completion_tokens"] == completion
    shot(page, "chat")


def test_the_tier_picker_changes_the_tier_label(stack, page):
    page.locator("#max-tokens").fill("4")
    for tier in ("flex", "priority"):
        page.locator("#tier").select_option(tier)
        reply = send(page, f"Say one word ({tier}).")
        finished(reply)
        assert figure(reply, "tier") == tier


def test_a_saved_router_lists_its_attempts(stack, page):
    page.locator("#model").select_option(ROUTER)
    page.locator("#tier").select_option("auto")
    reply = send(page, "Say hello.")
    finished(reply)
    attempts = reply.locator(".attempts li").all_inner_texts()
    assert len(attempts) == 2, attempts
    assert attempts[0].startswith("first:") and "failed: no first token within 1 ms" in attempts[0]
    assert attempts[1].startswith("fallback:") and attempts[1].endswith("served")
    assert "fallbacks 1" in reply.locator(".attempts strong").inner_text()
    page.locator("#model").select_option(DEFAULT_MODEL_ID)


def _workers(stack) -> dict[str, str]:
    health = httpx.get(f"{stack.url}/ready", timeout=10).json()
    return {wid: w["address"] for wid, w in health["workers"].items() if w["alive"]}


def _load(stack, address: str) -> dict:
    with stack.internal_auth.sync_channel(address) as channel:
        stats = pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=5)
    return json.loads(stats.json)["load"]


def test_stop_cancels_the_request_on_the_workers(stack, page):
    workers = _workers(stack)
    free = {w: _load(stack, a)["free_blocks"] for w, a in workers.items()}
    page.locator("#max-tokens").fill("1000")  # within this small KV pool
    page.locator("#temperature").fill("0.8")
    page.locator("#clear-chat").click()
    reply = send(page, "Tell me a very long story about a dragon, a knight and a city.")
    until(
        lambda: len(reply.locator(".text").text_content()) > 20,
        lambda: f"the reply to stream; the page shows {page.locator('main').inner_text()!r}",
    )
    busy = {w: _load(stack, a) for w, a in workers.items()}
    assert any(load["running"] for load in busy.values()), busy
    page.locator("#prompt").press("Escape")  # the keyboard's Stop
    reply.locator(".figures").wait_for()
    assert "stopped" in reply.get_attribute("class")
    deadline = time.monotonic() + SETTLE_S
    while True:
        loads = {w: _load(stack, a) for w, a in workers.items()}
        if all(
            load["running"] == 0 and load["free_blocks"] == free[w] for w, load in loads.items()
        ):
            break
        assert time.monotonic() < deadline, f"workers did not settle: {loads} (free {free})"
        time.sleep(0.1)
    assert page.locator("#stop").is_disabled()


def test_the_fleet_view_lists_every_worker(stack, page):
    page.locator("#tab-fleet").click()
    rows = page.locator("#fleet tr.worker")
    until(lambda: rows.count() >= 2, "the fleet's rows")
    listed = sorted(rows.nth(i).get_attribute("data-worker-id") for i in range(rows.count()))
    assert listed == sorted(_workers(stack))
    states = page.locator('#fleet td[data-column="state"]').all_inner_texts()
    assert states == ["serving", "serving"]
    assert "%" in page.locator('#fleet td[data-column="kv"]').first.inner_text()
    assert "%" in page.locator('#fleet td[data-column="host"]').first.inner_text()
    shot(page, "fleet")


def test_compare_sends_the_conversation_to_both_sides(stack, page):
    page.locator("#tab-compare").click()
    page.locator("#max-tokens").evaluate("e => e.value = '8'")
    page.locator("#temperature").evaluate("e => e.value = '0'")
    page.locator("#compare-model-b").select_option(ROUTER)
    page.locator("#compare-tier-b").select_option("flex")
    page.locator("#compare-prompt").fill("Name a colour.")
    page.locator("#compare-prompt").press("Enter")
    for side in ("a", "b"):
        page.locator(f"#compare-messages-{side} .message.assistant .figures").wait_for()
    a = page.locator("#compare-messages-a .message.assistant")
    b = page.locator("#compare-messages-b .message.assistant")
    assert figure(b, "tier") == "flex" and figure(a, "tier") == "default"
    assert b.locator(".attempts li").count() == 2 and a.locator(".attempts li").count() == 1
    # Greedy on both sides: the router's answering model is the same model.
    assert a.locator(".text").text_content() == b.locator(".text").text_content()
    shot(page, "compare")


def test_the_waterfall_reaches_the_workers_spans(stack, page):
    def open_first_reply_trace() -> set[str]:
        page.locator("#tab-chat").click()
        page.locator(".message.assistant .show-trace").first.click()
        page.locator("#waterfall svg").wait_for()
        texts = page.locator("#waterfall svg g.span text:not(.duration)").all_text_contents()
        return {t.strip().split(":")[0] for t in texts}

    deadline = time.monotonic() + 10  # the workers write their spans within a second or two
    while not {"coordinator", "prefill", "decode"} <= (seen := open_first_reply_trace()):
        assert time.monotonic() < deadline, seen
        page.wait_for_timeout(500)
    assert page.locator("#trace-list li").count() >= 1
    shot(page, "traces")
    assert page.console_errors == []
