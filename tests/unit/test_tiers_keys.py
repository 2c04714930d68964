"""API keys with tier entitlements: default tier, allowed tiers, 400/401/403, key files."""

from __future__ import annotations

import pytest

from services.coordinator.keys import ApiKey
from services.coordinator.main import api_settings
from services.coordinator.settings import APISettings
from shared.config.schema import ConfigError, parse_config
from tests.unit.coordinator_client import chat_body, meta, run_with_client
from tests.unit.scripted_backend import Script, ScriptedTestBackend

MODEL = "m"
BATCH_KEY = "sk-batch-only-0001"
PRO_KEY = "sk-pro-0000000002"
PLAIN_KEY = "sk-plain-00000003"


@pytest.fixture
def settings() -> APISettings:
    return APISettings(
        model_id=MODEL,
        api_keys=(PLAIN_KEY,),
        keys=(
            ApiKey("nightly-jobs", BATCH_KEY, "batch", ("batch", "flex")),
            ApiKey("pro-app", PRO_KEY, "priority", ("priority", "default")),
        ),
    )


def _post(tokenizer, settings, key: str | None, **body):
    backend = ScriptedTestBackend(tokenizer, {MODEL: Script()})
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def work(client):
        return await client.post("/v1/chat/completions", json=chat_body(**body), headers=headers)

    return run_with_client(backend, settings, work), backend


@pytest.mark.parametrize(
    ("key", "asked", "served"),
    [
        (BATCH_KEY, None, "batch"),
        (BATCH_KEY, "auto", "batch"),
        (BATCH_KEY, "flex", "flex"),
        (PRO_KEY, None, "priority"),
        (PRO_KEY, "default", "default"),
        (PLAIN_KEY, None, "default"),  # the old one-key-per-line file: every tier
        (PLAIN_KEY, "batch", "batch"),
    ],
)
def test_tier_served_follows_the_key(real_tokenizer, settings, key, asked, served):
    response, backend = _post(real_tokenizer, settings, key, service_tier=asked)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["service_tier"] == served
    assert meta(data, "cost")["tier"] == served
    priorities = {"priority": 0, "default": 1, "flex": 2, "batch": 3}
    assert backend.calls[0].request.priority == priorities[served]


def test_a_tier_the_key_may_not_use_is_403_naming_it(real_tokenizer, settings):
    response, backend = _post(real_tokenizer, settings, BATCH_KEY, service_tier="priority")
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["param"] == "service_tier" and error["code"] == "tier_not_allowed"
    assert "'priority'" in error["message"] and "batch, flex" in error["message"]
    assert backend.calls == []


def test_unknown_tier_is_400_listing_the_valid_ones(real_tokenizer, settings):
    response, _ = _post(real_tokenizer, settings, PRO_KEY, service_tier="gold")
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "'gold'" in message
    for tier in ("auto", "default", "priority", "flex", "batch"):
        assert tier in message


@pytest.mark.parametrize("key", [None, "sk-wrong-0000000", BATCH_KEY + "x"])
def test_missing_or_wrong_key_is_401(real_tokenizer, settings, key):
    response, _ = _post(real_tokenizer, settings, key)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_key_repr_never_shows_the_secret():
    assert "sk-" not in repr(ApiKey("pro-app", PRO_KEY))


def test_keys_inline_and_from_files_reach_the_settings(tmp_path):
    plain = tmp_path / "plain-keys"
    plain.write_text(f"# comment\n{PLAIN_KEY}\n")
    keyed = tmp_path / "keys.yaml"
    keyed.write_text(
        f"- name: batchers\n  key: {BATCH_KEY}\n  default_tier: batch\n  allowed_tiers: [batch]\n"
    )
    config = parse_config(
        {
            "coordinator": {"api_keys_file": str(plain)},
            "api_keys": {
                "file": str(keyed),
                "keys": [{"name": "pro", "key": PRO_KEY, "default_tier": "priority"}],
            },
        }
    )
    settings = api_settings(config)
    assert settings.api_keys == (PLAIN_KEY,)
    by_name = {k.name: k for k in settings.keyring.keys}
    assert by_name["batchers"].allowed_tiers == ("batch",)
    assert by_name["pro"].default_tier == "priority"
    assert by_name["pro"].allowed_tiers == ("priority", "default", "flex", "batch")


def test_bad_key_config_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="default_tier 'priority' is not among"):
        parse_config(
            {
                "api_keys": {
                    "keys": [
                        {
                            "name": "x",
                            "key": PRO_KEY,
                            "default_tier": "priority",
                            "allowed_tiers": ["batch"],
                        }
                    ]
                }
            }
        )
    bad_file = tmp_path / "keys.yaml"
    bad_file.write_text("- name: x\n  key: short\n")
    with pytest.raises(ConfigError, match="api_keys.file"):
        api_settings(parse_config({"api_keys": {"file": str(bad_file)}}))
