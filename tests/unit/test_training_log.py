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
from shared.training_log import (
    LoggedTurn,
    TrainingLogError,
    TrainingLogWriter,
    log_file_path,
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
    with pytest.raises(ValueError, match="only placeholder"):
        TrainingLogConfig(enabled=True, path="/logs/{hostname}.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrainingLogError, match="no training log"):
        read_training_log(tmp_path / "empty")


def test_each_host_writes_its_own_file_and_a_folder_is_read_in_record_time(tmp_path, monkeypatch):
    """A fleet's coordinators share a volume: `{host}` gives each its own file, and the reader
    merges the folder's files oldest first, whichever file a record is in."""
    pattern = str(tmp_path / "{host}.jsonl")
    assert log_file_path(pattern, "coordinator-7f9c") == tmp_path / "coordinator-7f9c.jsonl"
    clock = iter(range(100, 200))
    monkeypatch.setattr("shared.training_log.time.time", lambda: next(clock))
    writers = {}
    for host in ("pod-a", "pod-b"):
        monkeypatch.setattr("shared.training_log.socket.gethostname", lambda h=host: h)
        writers[host] = TrainingLogWriter(pattern, 1.0)
        assert writers[host].path == tmp_path / f"{host}.jsonl"
    # Interleaved in time across the two files.
    for i, host in enumerate(["pod-b", "pod-a", "pod-a", "pod-b"]):
        writers[host].write([LoggedTurn(MODEL, "default", [1, i], [2, i])])
    (tmp_path / "notes.txt").write_text("not a log")  # only *.jsonl files are read
    turns = read_training_log(tmp_path)
    assert [t.prompt_token_ids for t in turns] == [[1, 0], [1, 1], [1, 2], [1, 3]]
    assert [t.logged_at for t in turns] == [100, 101, 102, 103]
    assert [t.prompt_token_ids for t in read_training_log(tmp_path / "pod-a.jsonl")] == [
        [1, 1],
        [1, 2],
    ]


def test_a_record_still_being_appended_is_not_read_yet(tmp_path):
    log = tmp_path / "log.jsonl"
    TrainingLogWriter(log, 1.0).write([LoggedTurn(MODEL, "default", [1], [2])])
    with log.open("a") as f:
        f.write('{"v": 1, "time": 5, "model": "m", "tier": "default", "prompt_tok')
    assert [t.prompt_token_ids for t in read_training_log(log)] == [[1]]
    with log.open("a") as f:  # the writer finishes its line: now it is a record
        f.write('en_ids": [7], "completion_token_ids": [8]}\n')
    assert [t.prompt_token_ids for t in read_training_log(log)] == [[1], [7]]
