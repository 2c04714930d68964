"""The coordinator's training log: written only when the operator enabled it, token ids only
(no text), one record per finished choice, and about `sample_ratio` of the requests."""

from __future__ import annotations

import json
import logging
import random

import pytest

from services.coordinator.main import api_settings
from services.coordinator.settings import APISettings
from shared.config.schema import DeploymentConfig, TrainingLogConfig
from shared.speculative.training_log import (
    LoggedTurn,
    TrainingLogError,
    TrainingLogWriter,
    read_training_log,
)
from tests.unit.coordinator_client import run_with_client
from tests.unit.scripted_backend import Script, ScriptedTestBackend

MODEL = "m"
SECRET = "the quick brown fox"


def _serve(real_tokenizer, settings: APISettings, requests: int, **extra) -> list[dict]:
    backend = ScriptedTestBackend(real_tokenizer, {MODEL: Script(text="jumps over it")})

    async def work(client):
        bodies = []
        for i in range(requests):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"{SECRET} {i}"}],
                "max_tokens": 8,
                **extra,
            }
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            bodies.append(response.json())
        return bodies

    return run_with_client(backend, settings, work)


def test_off_by_default_and_nothing_written(real_tokenizer, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = api_settings(DeploymentConfig.model_validate({"models": [{"id": MODEL}]}))
    assert settings.training_log is None
    _serve(real_tokenizer, settings, 2)
    assert list(tmp_path.iterdir()) == []  # not even an empty default-named file


def test_enabled_log_holds_token_ids_only(real_tokenizer, tmp_path, caplog):
    path = tmp_path / "train.jsonl"
    raw = {
        "models": [{"id": MODEL}],
        "capture": {"training_log": {"enabled": True, "path": str(path), "sample_ratio": 1.0}},
    }
    settings = api_settings(DeploymentConfig.model_validate(raw))
    with caplog.at_level(logging.DEBUG):
        bodies = _serve(real_tokenizer, settings, 3, n=2)
    text = path.read_text()
    assert SECRET not in text and "jumps" not in text  # ids, never text
    assert SECRET not in caplog.text  # nor in the ordinary log
    records = [json.loads(line) for line in text.splitlines()]
    assert len(records) == 6  # every choice of every request
    assert all(set(r) == {"v", "time", "model", "tier", "prompt_token_ids",
                          "completion_token_ids"} for r in records)  # fmt: skip
    turns = read_training_log(path, model=MODEL)
    completion = real_tokenizer.decode(turns[0].completion_token_ids)
    # The served reply's ids, end-of-turn token included (the head learns where replies stop).
    assert completion.startswith(bodies[0]["choices"][0]["message"]["content"])
    assert turns[0].completion_token_ids[-1] in real_tokenizer.stop_token_ids
    assert SECRET in real_tokenizer.decode(turns[0].prompt_token_ids)
    assert turns[0].tier == "default"
    ids, prompt_len = turns[0].conversation
    assert ids[prompt_len:] == turns[0].completion_token_ids


@pytest.mark.parametrize("ratio", [0.0, 0.3])
def test_sample_ratio_is_respected(tmp_path, ratio):
    writer = TrainingLogWriter(tmp_path / "log.jsonl", ratio, random.Random(4))
    requests = 2000
    for i in range(requests):
        if writer.sampled():
            writer.write([LoggedTurn(MODEL, "default", [1, 2, i], [3, 4])])
    logged = len(read_training_log(tmp_path / "log.jsonl")) if writer.written else 0
    # Binomial(2000, 0.3): sd ~20.5; 5 sd either side.
    assert abs(logged - ratio * requests) <= 5 * (requests * ratio * (1 - ratio)) ** 0.5


def test_bad_config_and_bad_log_are_refused(tmp_path):
    with pytest.raises(ValueError):
        TrainingLogConfig(enabled=True, sample_ratio=1.5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"v": 1, "model": "m"}\n')
    with pytest.raises(TrainingLogError, match="bad.jsonl:1"):
        read_training_log(bad)
