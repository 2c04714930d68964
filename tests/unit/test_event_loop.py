"""Service processes run on uvloop where installed; SPLITSERVE_UVLOOP=0 keeps asyncio's own."""

from __future__ import annotations

import asyncio

import pytest

from shared.rpc import event_loop


async def _loop_type() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_the_services_run_on_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvloop", reason="uvloop is a dependency on this platform")
    monkeypatch.delenv(event_loop.ENV, raising=False)
    factory, which = event_loop.loop_factory()
    assert factory is not None and which == "uvloop"
    assert event_loop.run(_loop_type()).startswith("uvloop")


def test_the_switch_keeps_asyncios_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(event_loop.ENV, "0")
    factory, which = event_loop.loop_factory()
    assert factory is None and "SPLITSERVE_UVLOOP=0" in which
    assert event_loop.run(_loop_type()).startswith("asyncio")
