"""The playground's HTTP side without a browser: the page and its files come from the package
with a strict CSP, / redirects to it, saved routers are listed as models, the fleet view marks
dead and draining workers, and `playground_enabled: False` serves none of it."""

from __future__ import annotations

import asyncio
import time

import httpx

from services.coordinator.playground.fleet import FleetView
from services.coordinator.playground.routes import PlaygroundSources
from services.coordinator.playground.static_files import CONTENT_SECURITY_POLICY, StaticBundle
from services.coordinator.route.registry import WorkerInfo, WorkerRegistry
from services.coordinator.settings import APISettings
from shared.config.policy import SavedRouter
from shared.config.schema import DeploymentConfig, parse_config
from shared.wire.records import WorkerLoad
from tests.unit.coordinator_client import run_with_client
from tests.unit.scripted_backend import Script, ScriptedTestBackend

MODEL = "SmolLM2-135M-Instruct"


def _settings(**extra) -> APISettings:
    return APISettings(model_id=MODEL, **extra)


def test_page_and_files_are_served_with_a_strict_csp(real_tokenizer):
    backend = ScriptedTestBackend(real_tokenizer, {MODEL: Script()})

    async def work(client: httpx.AsyncClient):
        root = await client.get("/")
        page = await client.get("/playground/")
        names = StaticBundle("services.coordinator.playground", "web").names
        files = {n: await client.get(f"/playground/{n}") for n in names}
        again = await client.get(
            "/playground/main.js", headers={"If-None-Match": files["main.js"].headers["etag"]}
        )
        missing = await client.get("/playground/../app.py")
        config = await client.get("/playground/api/config")
        return root, page, files, again, missing, config

    root, page, files, again, missing, config = run_with_client(backend, _settings(), work)
    assert root.status_code == 307 and root.headers["location"] == "/playground/"
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert (
        "script-src 'self'" in CONTENT_SECURITY_POLICY and "unsafe" not in CONTENT_SECURITY_POLICY
    )
    assert page.headers["x-content-type-options"] == "nosniff"
    assert {"index.html", "main.js", "playground.css"} <= set(files)
    for name, resp in files.items():
        assert resp.status_code == 200, name
        assert resp.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert files["main.js"].headers["content-type"].startswith("text/javascript")
    # Offline: nothing is loaded from another origin.
    for resp in files.values():
        assert "http://" not in resp.text.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in resp.text
    assert again.status_code == 304
    assert missing.status_code == 404
    assert config.json() == {
        "auth_required": False,
        "service_tiers": ["auto", "default", "priority", "flex", "batch"],
        "tracing": False,
        "fleet": False,
    }


def test_saved_routers_are_listed_with_the_models(real_tokenizer):
    backend = ScriptedTestBackend(real_tokenizer, {MODEL: Script()})
    routes = {"chat": SavedRouter(models=[MODEL])}

    async def work(client: httpx.AsyncClient):
        return (await client.get("/v1/models")).json(), await client.get("/v1/models/router/chat")

    listed, one = run_with_client(backend, _settings(saved_routers=routes), work)
    assert [m["id"] for m in listed["data"]] == [MODEL, "router/chat"]
    assert one.status_code == 200 and one.json()["owned_by"] == "router"


def test_disabled_playground_serves_nothing(real_tokenizer):
    backend = ScriptedTestBackend(real_tokenizer, {MODEL: Script()})

    async def work(client: httpx.AsyncClient):
        return [
            await client.get(p)
            for p in ("/", "/playground/", "/playground/api/config", "/playground/api/fleet")
        ]

    for resp in run_with_client(backend, _settings(playground_enabled=False), work):
        assert resp.status_code == 404


def test_config_schema_has_the_playground_switch():
    assert DeploymentConfig().playground.enabled is True
    assert parse_config({"playground": {"enabled": False}}).playground.enabled is False


def _worker(worker_id: str, role: str, **extra) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        role=role,
        model=MODEL,
        address="127.0.0.1:1",  # nothing listens: the Stats call fails fast
        transfer_agent="",
        max_model_len=2048,
        load=WorkerLoad(running=1, waiting=2, free_blocks=30, total_blocks=40),
        **extra,
    )


def test_fleet_view_marks_dead_and_draining_workers(real_tokenizer):
    config = DeploymentConfig()
    registry = WorkerRegistry(config, {})
    registry.register(_worker("w-prefill-0", "prefill"))
    registry.register(_worker("w-decode-0", "decode"))
    registry.register(_worker("w-decode-1", "decode"))
    registry.mark_dead("w-decode-1", "test")
    assert registry.heartbeat("w-decode-0", WorkerLoad(total_blocks=10), draining=True)
    assert [w.worker_id for w in registry.routable(MODEL)] == ["w-prefill-0"]  # no new work
    registry.workers["w-prefill-0"].last_seen = time.monotonic()
    backend = ScriptedTestBackend(real_tokenizer, {MODEL: Script()})
    fleet = FleetView(registry, refresh_s=60)

    async def work(client: httpx.AsyncClient):
        first = (await client.get("/playground/api/fleet")).json()
        registry.mark_dead("w-prefill-0", "test")
        second = (await client.get("/playground/api/fleet")).json()  # within refresh_s
        await fleet.close()
        return first, second

    def run(work):
        from services.coordinator.api.app import create_app

        app = create_app(backend, _settings(), playground=PlaygroundSources(fleet=fleet))

        async def main():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
                return await work(client)

        return asyncio.run(main())

    first, second = run(work)
    (model,) = first["models"]
    assert (model["id"], model["expected_workers"], model["serving_workers"]) == (MODEL, 2, 1)
    rows = {w["worker_id"]: w for w in model["workers"]}
    assert {k: w["state"] for k, w in rows.items()} == {
        "w-prefill-0": "serving",
        "w-decode-0": "draining",
        "w-decode-1": "dead",
    }
    serving = rows["w-prefill-0"]
    assert serving["kv_cache_usage"] == 0.25 and serving["load"]["waiting"] == 2
    assert serving["stats_error"].startswith("Stats: ")  # shown without stats, not waited on
    assert rows["w-decode-1"]["stats_error"] == "dead: not asked"
    assert second == first  # one snapshot per refresh_s, however many pollers
