"""Saved routers: CEL conditions, sticky weighted A/B variants, config refusals, 404s."""

from __future__ import annotations

import collections

import pytest

from services.coordinator.errors import APIError
from services.coordinator.main import check_policy
from services.coordinator.route.saved_routers import SavedRouters, bucket
from services.coordinator.settings import APISettings
from shared.config.schema import ConfigError, parse_config
from tests.unit.coordinator_client import chat_body, meta, run_with_client
from tests.unit.scripted_backend import Script, ScriptedTestBackend

BIG, SMALL, CANARY = "big", "small", "canary"

ROUTERS = {
    "smart": {
        "models": [SMALL],
        "fallback": {"ttft_timeout": 250},
        "conditions": [
            {"when": 'request.metadata.plan == "pro"', "models": [BIG, SMALL]},
            {"when": "size(request.messages) > 4", "models": [BIG]},
            {"when": 'request.user.startsWith("vip")', "models": [CANARY]},
        ],
    },
    "ab": {
        "variants": [
            {"name": "control", "weight": 3, "models": [SMALL]},
            {"name": "treatment", "weight": 1, "models": [CANARY]},
            {"name": "off", "weight": 0, "models": [BIG]},
        ]
    },
}


def _routes() -> SavedRouters:
    return SavedRouters(dict(parse_config({"routers": ROUTERS}).routers))


def _view(metadata=None, messages=1, user="") -> dict:
    return {
        "metadata": metadata or {},
        "messages": [{"role": "user", "content": "hi"}] * messages,
        "user": user,
        "model": "router/smart",
        "service_tier": "auto",
    }


@pytest.mark.parametrize(
    ("view", "models", "why"),
    [
        (_view({"plan": "pro"}), [BIG, SMALL], "condition 0"),
        (_view({"plan": "free"}, messages=5), [BIG], "condition 1"),
        (_view(user="vip-42"), [CANARY], "condition 2"),
        (_view({"plan": "free"}, user="joe"), [SMALL], "no condition matched"),
    ],
)
def test_conditions_pick_the_first_match(view, models, why):
    choice = _routes().choose("smart", view)
    assert choice.models == models
    assert choice.ttft_timeout_ms == 250
    assert any(why in line for line in choice.reasoning)


def test_a_condition_on_a_missing_field_does_not_match():
    choice = _routes().choose("smart", _view(user="someone"))  # no metadata.plan at all
    assert choice.models == [SMALL]
    assert any("not evaluable" in line for line in choice.reasoning)


def test_ab_variant_is_sticky_per_user_and_never_picks_zero_weight():
    routers = _routes()
    for user in ("alice", "bob", "carol", "dave"):
        picks = {tuple(routers.choose("ab", _view(user=user)).models) for _ in range(20)}
        assert len(picks) == 1
        assert picks != {(BIG,)}


def test_ab_proportions_follow_the_weights():
    routers = _routes()
    counts = collections.Counter(
        routers.choose("ab", _view(user=f"user-{i}")).models[0] for i in range(2000)
    )
    # 3:1 split; binomial sd over 2000 users is ~1%, so 4% is a wide, stable margin.
    assert abs(counts[SMALL] / 2000 - 0.75) < 0.04
    assert abs(counts[CANARY] / 2000 - 0.25) < 0.04
    assert counts[BIG] == 0


def test_buckets_differ_between_routers():
    same = sum((bucket("a", f"u{i}") < 0.5) == (bucket("b", f"u{i}") < 0.5) for i in range(1000))
    assert 400 < same < 600  # independent splits, not the same users in both treatments


def test_unknown_router_is_404_naming_it():
    with pytest.raises(APIError) as info:
        _routes().choose("nope", _view())
    assert info.value.status == 404 and "router/nope" in info.value.message


@pytest.mark.parametrize(
    ("router", "message"),
    [
        (
            {
                "models": ["m"],
                "conditions": [{"when": "request.metadata.plan ==", "models": ["m"]}],
            },
            "router 'bad': condition 0 `request.metadata.plan ==` does not compile",
        ),
        (
            {"variants": [{"name": "a", "weight": 0, "models": ["m"]}]},
            "router 'bad': variant weights must sum to a positive number",
        ),
        ({"conditions": [{"when": "true", "models": ["m"]}]}, "needs `models` or `variants`"),
    ],
)
def test_bad_router_config_is_refused(router, message):
    with pytest.raises(ConfigError, match="routers") as info:
        parse_config({"routers": {"bad": router}})
    assert message in str(info.value)


def test_routers_must_name_served_models():
    config = parse_config({"routers": {"r": {"models": ["not-served"]}}})
    with pytest.raises(ConfigError, match=r"routers.r: models \['not-served'\] are not served"):
        check_policy(config)


def test_saved_router_over_http(real_tokenizer):
    backend = ScriptedTestBackend(
        real_tokenizer,
        {BIG: Script(first_token_delay_s=5.0), SMALL: Script(), CANARY: Script()},
    )
    settings = APISettings(
        model_id=SMALL, saved_routers=dict(parse_config({"routers": ROUTERS}).routers)
    )

    async def work(client):
        pro = await client.post(
            "/v1/chat/completions",
            json=chat_body(model="router/smart", metadata={"plan": "pro"}),
        )
        missing = await client.post("/v1/chat/completions", json=chat_body(model="router/gone"))
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        tool_turns = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
        ]
        tools = await client.post(  # conditions read a content-less assistant turn as ""
            "/v1/chat/completions", json=chat_body(model="router/smart", messages=tool_turns)
        )
        return pro, missing, tools

    pro, missing, tools = run_with_client(backend, settings, work)
    assert tools.status_code == 200 and tools.json()["model"] == SMALL, tools.text
    data = pro.json()
    assert data["model"] == SMALL  # BIG missed the router's 250 ms deadline
    assert [a["model"] for a in meta(data, "attempts")] == [BIG, SMALL]
    reasoning = meta(data, "reasoning")
    assert reasoning[0] == 'router smart: condition 0 `request.metadata.plan == "pro"` matched'
    assert any("missed the 250 ms TTFT deadline" in line for line in reasoning)
    assert missing.status_code == 404
    assert "router/gone" in missing.json()["error"]["message"]
