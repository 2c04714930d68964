"""`splitserve trace` draws a recorded request as a waterfall: the span tree in order,
durations, the gaps nobody measured, errors; it finds traces by id prefix or recency."""

from __future__ import annotations

import argparse
import json

import pytest

from shared.telemetry.records import EventRecord, SpanRecord
from tools.commands import trace_cmd
from tools.commands.waterfall import render

MS = 1_000_000
T0 = 1_750_000_000 * 10**9  # some wall-clock instant, in ns


def _span(trace, span, parent, name, service, start_ms, end_ms, **kw) -> SpanRecord:
    return SpanRecord(
        trace_id=trace,
        span_id=span,
        parent_span_id=parent,
        name=name,
        kind=kw.pop("kind", "INTERNAL"),
        service=f"splitserve-{service}",
        start_ns=T0 + int(start_ms * MS),
        end_ns=T0 + int(end_ms * MS),
        **kw,
    )


def request_trace(trace_id: str, offset_ms: float = 0.0, error: bool = False) -> list[SpanRecord]:
    o = offset_ms
    return [
        _span(
            trace_id, "a" * 16, None, "chat SmolLM2", "coordinator", o, o + 400, kind="SERVER",
            attributes={"gen_ai.request.model": "SmolLM2", "gen_ai.usage.output_tokens": 8},
            events=[EventRecord("splitserve.first_token", T0 + int((o + 150) * MS))],
        ),
        _span(trace_id, "b" * 16, "a" * 16, "splitserve.route", "coordinator", o + 1, o + 1.2),
        _span(trace_id, "c" * 16, "a" * 16, "splitserve.prefill", "coordinator", o + 2, o + 150,
              kind="CLIENT"),
        _span(trace_id, "d" * 16, "c" * 16, "splitserve.prefill", "prefill", o + 3, o + 149,
              kind="SERVER"),
        _span(trace_id, "e" * 16, "d" * 16, "splitserve.prefill.chunk", "prefill", o + 4, o + 100),
        _span(trace_id, "f" * 16, "d" * 16, "splitserve.kv_transfer", "prefill", o + 120, o + 148,
              status="ERROR" if error else "UNSET",
              status_message="KV transfer failed: no room" if error else ""),
        _span(trace_id, "1" * 16, "a" * 16, "splitserve.decode", "coordinator", o + 151, o + 399,
              kind="CLIENT"),
        _span(trace_id, "2" * 16, "1" * 16, "splitserve.decode", "decode", o + 152, o + 398,
              kind="SERVER"),
    ]  # fmt: skip


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "traces.jsonl"
    spans = request_trace("11" * 16) + request_trace("22" * 16, 1000, error=True)
    spans += request_trace("23" * 16, 2000)
    path.write_text("".join(json.dumps(s.to_json()) + "\n" for s in spans))
    return path


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    trace_cmd.add_commands(sub)
    args = parser.parse_args(["trace", *argv])
    return args.handler(args)


def test_waterfall_shows_tree_durations_and_gaps():
    text = render(request_trace("ab" * 16), width=120)
    lines = text.splitlines()
    assert lines[0].startswith("trace " + "ab" * 16)
    assert "400.0 ms" in lines[0] and "8 spans" in lines[0]
    assert "coordinator, decode, prefill" in lines[0]
    names = [line.split()[0] for line in lines[2:] if not line.lstrip().startswith(("*", "-"))]
    assert names == [
        "chat",
        "splitserve.route",
        "splitserve.prefill",
        "splitserve.prefill",
        "splitserve.prefill.chunk",
        "splitserve.kv_transfer",
        "splitserve.decode",
        "splitserve.decode",
    ]
    chunk = next(line for line in lines if "splitserve.prefill.chunk" in line)
    assert "prefill" in chunk and " 4.0 " in chunk and " 96.0 " in chunk  # start, duration
    gaps = [line for line in lines if line.strip().startswith("- gap")]
    # Between the chunk (ends at 100 ms) and the transfer (starts at 120 ms): 20 ms unaccounted.
    assert any(" 100.0 " in g and " 20.0 " in g for g in gaps)
    assert any("* splitserve.first_token" in line for line in lines)
    assert all(len(line) <= 160 for line in lines)


def test_verbose_shows_attributes_and_errors_are_marked():
    text = render(request_trace("cd" * 16, error=True), verbose=True)
    assert "gen_ai.request.model = SmolLM2" in text
    assert "! KV transfer failed: no room" in text
    assert "errors: 1" in text.splitlines()[0]


def test_orphans_are_drawn_when_the_root_is_missing():
    spans = request_trace("ef" * 16)[1:]  # the coordinator's root span was lost
    text = render(spans)
    assert "splitserve.route" in text and "splitserve.decode" in text


def test_cli_renders_the_last_trace_by_default(trace_file, capsys):
    assert _run("--file", str(trace_file)) == 0
    out = capsys.readouterr().out
    assert out.count("trace ") == 1 and "23" * 16 in out


def test_cli_last_n_list_and_trace_id_prefix(trace_file, capsys):
    assert _run("--file", str(trace_file), "--last", "2") == 0
    out = capsys.readouterr().out
    assert "22" * 16 in out and "23" * 16 in out and "11" * 16 not in out
    assert _run("--file", str(trace_file), "--list") == 0
    listing = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listing] == ["11" * 16, "22" * 16, "23" * 16]
    assert "errors=1" in listing[1]
    assert _run("--file", str(trace_file), "--trace-id", "1111", "-v") == 0
    assert "gen_ai.usage.output_tokens = 8" in capsys.readouterr().out


def test_cli_errors_name_the_problem(trace_file, tmp_path, capsys):
    assert _run("--file", str(tmp_path / "missing.jsonl")) == 2
    assert "no trace file" in capsys.readouterr().err
    assert _run("--file", str(trace_file), "--trace-id", "2") == 2  # 22… and 23…: ambiguous
    assert "2 traces" in capsys.readouterr().err
    assert _run("--file", str(trace_file), "--trace-id", "99") == 2
    assert "no trace" in capsys.readouterr().err


def test_cli_reads_the_file_named_in_the_config(trace_file, tmp_path, capsys):
    config = tmp_path / "deploy.yaml"
    config.write_text(f"telemetry:\n  exporter: file\n  file: {trace_file}\n")
    assert _run("--config", str(config), "--list") == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
