"""Ports the launcher picks for its children: below the kernel's ephemeral range, where no
other process's bind to port 0 or outgoing connection takes them before the child binds."""

from __future__ import annotations

import socket

import pytest

from services.launcher import ports
from services.launcher.ports import ephemeral_range, pick_free_ports


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_ports_are_distinct_free_and_below_the_ephemeral_range():
    span = ephemeral_range()
    if span is None:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range here")
    chosen = pick_free_ports(20)
    assert len(set(chosen)) == 20
    assert all(ports.LOWEST_PORT <= p < span[0] for p in chosen)
    assert all(_bindable(p) for p in chosen)  # released before they are returned


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        busy.listen()
        # Only the busy port and one other are candidates: the busy one is skipped.
        monkeypatch.setattr(ports, "LOWEST_PORT", taken - 1)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (taken + 1, taken + 2))
        if not _bindable(taken - 1):
            pytest.skip(f"port {taken - 1} is in use here")
        assert pick_free_ports(1) == [taken - 1]
        # With no candidate left, the kernel's own choice (never the busy port).
        (fallback,) = pick_free_ports(2)[1:]
        assert fallback != taken and fallback != taken - 1


def test_without_a_readable_range_the_kernel_chooses(monkeypatch, tmp_path):
    assert ephemeral_range(tmp_path / "missing") is None
    bad = tmp_path / "range"
    bad.write_text("not numbers")
    assert ephemeral_range(bad) is None
    good = tmp_path / "good"
    good.write_text("32768\t60999\n")
    assert ephemeral_range(good) == (32768, 60999)
    monkeypatch.setattr(ports, "ephemeral_range", lambda: None)
    chosen = pick_free_ports(3)
    assert len(set(chosen)) == 3 and all(_bindable(p) for p in chosen)
