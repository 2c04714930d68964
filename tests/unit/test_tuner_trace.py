"""Trace parsing: both formats, scaling, and errors that name the file and the line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tools.tuner.trace import MOONCAKE_BLOCK_TOKENS, TraceError, load_trace

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _mooncake(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_mooncake_rows_become_arrays_with_block_ids(tmp_path):
    path = _write(
        tmp_path,
        "t.jsonl",
        _mooncake(
            [
                {"timestamp": 1000, "input_length": 600, "output_length": 20, "hash_ids": [0, 1]},
                {"timestamp": 1500, "input_length": 100, "output_length": 0, "hash_ids": [0]},
            ]
        ),
    )
    trace = load_trace(path)
    assert trace.format == "mooncake"
    assert trace.arrival_ms.tolist() == [0.0, 500.0]  # first request at 0
    assert trace.input_tokens.tolist() == [600, 100]
    assert trace.output_tokens.tolist() == [20, 1]  # a logged 0 still yields one token
    assert trace.hash_ids == [(0, 1), (0,)]
    assert trace.block_tokens == MOONCAKE_BLOCK_TOKENS


def test_unsorted_rows_are_replayed_in_time_order(tmp_path):
    rows = [
        {"timestamp": 30, "input_length": 3, "output_length": 1, "hash_ids": [3]},
        {"timestamp": 10, "input_length": 1, "output_length": 1, "hash_ids": [1]},
    ]
    trace = load_trace(_write(tmp_path, "t.jsonl", _mooncake(rows)))
    assert trace.input_tokens.tolist() == [1, 3]
    assert trace.hash_ids == [(1,), (3,)]


def test_azure_csv_with_seven_digit_fractions_and_midnight(tmp_path):
    text = (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 23:59:59.5000000,374,44\n"
        "2023-11-17 00:00:00.2500000,396,109\n"
    )
    trace = load_trace(_write(tmp_path, "a.csv", text))
    assert trace.format == "azure"
    assert trace.hash_ids is None
    assert np.allclose(trace.arrival_ms, [0.0, 750.0])
    assert trace.input_tokens.tolist() == [374, 396]
    assert trace.output_tokens.tolist() == [44, 109]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not a JSON object"),
        ('{"timestamp": 5, "input_length": 10}', "missing output_length"),
        ('{"timestamp": 5, "input_length": 0, "output_length": 3}', "input_length must be >= 1"),
        ('{"timestamp": 5, "input_length": 2.5, "output_length": 3}', "must be an integer"),
        ('{"timestamp": -1, "input_length": 2, "output_length": 3}', "timestamp"),
        ('{"timestamp": 5, "input_length": 2, "output_length": 3, "hash_ids": "x"}', "hash_ids"),
        ("[1, 2, 3]", "expected a JSON object"),
    ],
)
def test_a_bad_mooncake_row_names_its_line(tmp_path, line, message):
    good = _mooncake([{"timestamp": 0, "input_length": 5, "output_length": 5, "hash_ids": [1]}])
    path = _write(tmp_path, "bad.jsonl", good + "\n" + line + "\n")
    with pytest.raises(TraceError) as err:
        load_trace(path)
    assert f"{path}:3:" in str(err.value)  # line 2 is blank and skipped, line 3 is bad
    assert message in str(err.value)


@pytest.mark.parametrize(
    "row, message",
    [
        ("2023-11-16 18:15:46.68,374", "expected 3 columns"),
        ("yesterday,374,44", "TIMESTAMP 'yesterday'"),
        ("2023-11-16 18:15:46.68,lots,44", "ContextTokens must be an integer"),
        ("2023-11-16 18:15:46.68,374,-2", "GeneratedTokens must be >= 0"),
    ],
)
def test_a_bad_azure_row_names_its_line(tmp_path, row, message):
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
    path = _write(tmp_path, "bad.csv", text + row + "\n")
    with pytest.raises(TraceError) as err:
        load_trace(path)
    assert f"{path}:3:" in str(err.value)
    assert message in str(err.value)


def test_an_unknown_format_is_refused_naming_the_line(tmp_path):
    path = _write(tmp_path, "what.txt", "\n\nrequest 1 at noon\n")
    with pytest.raises(TraceError) as err:
        load_trace(path)
    assert f"{path}:3: unknown trace format" in str(err.value)
    assert "Mooncake JSONL" in str(err.value) and "Azure CSV" in str(err.value)


def test_a_csv_without_the_azure_columns_is_refused(tmp_path):
    path = _write(tmp_path, "x.csv", "TIMESTAMP,Prompt,Reply\n1,2,3\n")
    with pytest.raises(TraceError, match=r"x\.csv:1: CSV header lacks ContextTokens"):
        load_trace(path)


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(TraceError, match="empty"):
        load_trace(_write(tmp_path, "e.jsonl", "\n \n"))
    with pytest.raises(TraceError, match="does not exist"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(_write(tmp_path, "h.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"))


def test_scaling_stretches_time_and_shrinks_lengths_within_the_context(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1600, "output_length": 40, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 100, "input_length": 90000, "output_length": 9000, "hash_ids": [4]},
    ]
    trace = load_trace(_write(tmp_path, "t.jsonl", _mooncake(rows)))
    scaled = trace.scaled(time_scale=2.0, length_scale=0.25, max_context=8192)
    assert scaled.arrival_ms.tolist() == [0.0, 200.0]
    assert scaled.input_tokens[0] == 400 and scaled.output_tokens[0] == 10
    assert scaled.block_tokens == MOONCAKE_BLOCK_TOKENS * 0.25
    # 22500 + 2250 does not fit 8192 tokens: cut, and counted.
    assert scaled.input_tokens[1] + scaled.output_tokens[1] <= 8192
    assert scaled.clipped == 1
    window = scaled.window(1, 1)
    assert window.arrival_ms.tolist() == [0.0] and window.hash_ids == [(4,)]


def test_the_shipped_traces_parse():
    mooncake = load_trace(REPO / "traces" / "mooncake_conversation_trace.jsonl")
    azure = load_trace(REPO / "traces" / "AzureLLMInferenceTrace_conv.csv")
    assert len(mooncake) == 12031 and mooncake.hash_ids is not None
    assert len(azure) == 19366 and azure.hash_ids is None
    assert np.all(np.diff(mooncake.arrival_ms) >= 0) and np.all(np.diff(azure.arrival_ms) >= 0)
    assert 3500 < mooncake.duration_s < 3600 and 3400 < azure.duration_s < 3600
