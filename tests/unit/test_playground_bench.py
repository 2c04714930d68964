"""`bench overhead --playground`: the modes alternate which goes first, and the poller asks a
real coordinator's fleet view once a second, as an open browser tab does."""

from __future__ import annotations

import asyncio

import tools.bench.playground_bench as bench
from services.coordinator.api.app import create_app
from services.coordinator.api.server import ServerThread
from services.coordinator.playground.fleet import FleetView
from services.coordinator.playground.routes import PlaygroundSources
from services.coordinator.route.registry import WorkerInfo, WorkerRegistry
from services.coordinator.settings import APISettings
from shared.config.schema import DeploymentConfig
from tests.unit.scripted_backend import Script, ScriptedTestBackend
from tools.bench.playground_bench import MODES, order, poll_fleet, round_ratios, table_rows
from tools.commands.trace_cmd import add_bench

MODEL = "SmolLM2-135M-Instruct"


def test_each_mode_goes_first_in_half_the_rounds():
    firsts = [order(r)[0] for r in range(6)]
    assert sorted(firsts) == sorted(MODES * 3)
    assert all(sorted(order(r)) == sorted(MODES) for r in range(6))


def test_the_poller_reads_the_fleet_view_until_stopped(real_tokenizer, monkeypatch):
    """Each poll is a real GET that must list the workers; the poller ends once stopped.
    (Its 1 s cadence is the benchmark's setting; the interval is shortened here so the test
    waits on no clock.)"""
    monkeypatch.setattr(bench, "POLL_INTERVAL_S", 0.01)
    registry = WorkerRegistry(DeploymentConfig(), {})
    registry.register(WorkerInfo("w-decode-0", "decode", MODEL, "127.0.0.1:1", "", 2048))
    fleet = FleetView(registry, refresh_s=0.01)
    backend = ScriptedTestBackend(real_tokenizer, {MODEL: Script()})
    app = create_app(backend, APISettings(model_id=MODEL), playground=PlaygroundSources(fleet))

    async def poll_until(url: str, polls: int) -> list[float]:
        latencies: list[float] = []
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_fleet(url, latencies, stop))
        while len(latencies) < polls and not poller.done():
            await asyncio.sleep(0.005)
        stop.set()
        await asyncio.wait_for(poller, 10)  # re-raises a failed poll
        return latencies

    with ServerThread(app) as server:
        latencies = asyncio.run(poll_until(f"{server.url}/playground/api/fleet", 3))
    assert len(latencies) >= 3
    assert all(ms > 0 for ms in latencies)


def test_the_cli_offers_the_mode_and_the_table_quotes_the_key():
    import argparse

    parser = argparse.ArgumentParser()
    add_bench(parser.add_subparsers())
    assert parser.parse_args(["overhead", "--playground"]).playground is True
    summary = {"throughput_tok_s": 100.0, "ttft_p50_ms": 50.0, "itl_p50_ms": 20.0, "errors": 0}
    result = {
        "off": summary,
        "fleet_poller": {**summary, "throughput_tok_s": 99.0},
        "playground_throughput_ratio": 0.99,
        "fleet_poll_p50_ms": 3.0,
        "fleet_poll_p99_ms": 5.0,
        "fleet_polls": 40,
        "round_ratios": [0.97, 1.01],
        "round_ratio_median": 0.97,
    }
    rows = {name: (ours, ref, ratio) for name, ours, ref, ratio in table_rows(result)}
    assert rows["playground_throughput_ratio (>= target)"] == (0.99, 0.98, None)
    assert rows["throughput tok/s (poller vs off)"] == (99.0, 100.0, 0.99)
    assert rows["  per-round ratios, median"] == ("0.970..1.010", None, 0.97)


def test_round_ratios_pair_the_modes_of_each_round():
    rounds = [{"off": 10.0, "fleet_poller": 9.0}, {"fleet_poller": 12.0, "off": 10.0}, {"off": 0}]
    assert round_ratios(rounds) == [0.9, 1.2]
