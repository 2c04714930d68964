"""`helm test`'s pod script, exactly as rendered, against the real coordinator app serving the
real SmolLM2 through an in-process engine, with API keys on."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.chart.conftest import render

pytestmark = pytest.mark.real_model

KEY = "sk-test-hook-key"


@pytest.fixture(scope="module")
def coordinator(real_model, real_tokenizer):
    from engine.core.config import EngineConfig
    from engine.core.engine import Engine
    from services.coordinator.api.app import create_app
    from services.coordinator.api.server import ServerThread
    from services.coordinator.settings import APISettings
    from tools.inprocess.engine_backend import EngineBackend

    model_id = "SmolLM2-135M-Instruct"  # models[0].id in values.yaml
    engine = Engine(EngineConfig(num_blocks=64, block_size=16), real_model, real_tokenizer)
    backend = EngineBackend(engine, model_id=model_id).start()
    settings = APISettings(model_id=model_id, api_keys=(KEY,))
    with ServerThread(create_app(backend, settings)) as server:
        yield server.url
    backend.close()


def run_hook(coordinator_url: str, keys_file) -> subprocess.CompletedProcess:
    pod = next(
        p for p in render("default").of_kind("Pod") if p["metadata"]["name"].endswith("-test-chat")
    )
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["python", "-c"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["COORDINATOR_URL"] == "http://rel-splitserve-coordinator.serving.svc:80"
    assert env["API_KEYS_FILE"] == "/etc/splitserve-secrets/api-keys"
    # The same script and settings, pointed at the local server and a local key file.
    env.update(COORDINATOR_URL=coordinator_url, API_KEYS_FILE=str(keys_file), TIMEOUT_S="10")
    return subprocess.run(
        [sys.executable, "-c", container["args"][0]],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_hook_gets_a_real_chat_completion(coordinator, tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text(f"# rotated monthly\n{KEY}\nsk-next-key\n")
    done = run_hook(coordinator, keys)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok: SmolLM2-135M-Instruct answered ")
    tokens = int(re.search(r"\((\d+) tokens\)$", done.stdout.rstrip())[1])
    assert 1 <= tokens <= 8  # tests.maxTokens


def test_the_hook_fails_on_a_wrong_key(coordinator, tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text("sk-wrong\n")
    done = run_hook(coordinator, keys)
    assert done.returncode != 0
    assert "chat completion failed: HTTP Error 401" in done.stderr
