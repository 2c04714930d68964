"""The NIXL (UCX) backend: two real processes on loopback, plus its stop/fence protocol.

``nixl`` is a hard dependency: these tests fail, not skip, when it cannot be imported. The
construction error a missing package gives is tested too. NIXL is only ever loaded in the
child processes: its bundled protobuf/abseil libraries crash a process that also loads
grpc_tools' protoc extension, and the test process may.
"""

from __future__ import annotations

import sys
import time

import pytest
import torch

from engine.kvcache.pool import KVLayout
from services.kvtransfer.nixl import NixlTransferBackend, NixlUnavailableError, nixl_import_error
from tools.bench.transfer_peer import PeerPlan, PeerProcess, alarm_after

NIXL_IMPORT_ERROR = nixl_import_error()

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=torch.float16)
NUM_BLOCKS = 40
# 4 MiB blocks: 64 of them take NIXL about 0.8 s over UCX's tcp transport on loopback, so an
# abort issued right after the send lands while the write is in flight.
BIG = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.float32)
BIG_BLOCKS = 64


@pytest.fixture(autouse=True)
def _hard_timeout():
    with alarm_after(90):
        yield


def test_nixl_is_importable():
    # A hard dependency (pyproject.toml): its absence is a broken install, not a skip.
    assert NIXL_IMPORT_ERROR == "", f"nixl is not importable: {NIXL_IMPORT_ERROR}"


def test_missing_nixl_is_a_clear_construction_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl._api", None)  # makes the import raise ImportError
    with pytest.raises(NixlUnavailableError, match="needs the `nixl` package"):
        NixlTransferBackend("nowhere")


@pytest.fixture(scope="module")
def pair():
    with alarm_after(90):
        prefill = PeerProcess(PeerPlan("nixl", "nixl-prefill", LAYOUT, NUM_BLOCKS, 0.3))
        decode = PeerProcess(PeerPlan("nixl", "nixl-decode", LAYOUT, NUM_BLOCKS, 0.3))
        pre_md, dec_md = prefill.register(), decode.register()
        prefill.add_peer(dec_md)
        decode.add_peer(pre_md)
    yield prefill, decode
    prefill.stop()
    decode.stop()


def test_blocks_arrive_bit_identical_across_processes(pair):
    prefill, decode = pair
    src, dst = [0, 1, 2, 17, 39, 8], [30, 31, 32, 4, 5, 12]
    digest = prefill.fill(src, seed=3)
    untouched = [i for i in range(NUM_BLOCKS) if i not in dst]
    before = decode.digest(untouched)
    remote = decode.prepare_receive("nixl-copy", dst, 10.0)
    assert [b.addr for b in remote.blocks] != dst  # registered addresses, not block ids
    prefill.send("nixl-copy", src, remote, 8.0)
    assert prefill.wait("nixl-copy")["state"] == "done"
    assert decode.wait("nixl-copy")["state"] == "done"
    assert decode.digest(dst) == digest
    assert decode.digest(untouched) == before
    assert prefill.releases()["nixl-copy"] == ["done"]
    assert decode.releases()["nixl-copy"] == ["done"]


def test_receiver_times_out_when_nobody_sends(pair):
    _, decode = pair
    decode.prepare_receive("nixl-nobody", [1], 0.2)
    assert decode.wait("nixl-nobody")["state"] == "timed_out"
    assert decode.releases()["nixl-nobody"] == ["timed_out"]


def test_receiver_killed_sender_fails_well_before_its_deadline(pair):
    prefill, _ = pair
    with PeerProcess(PeerPlan("nixl", "nixl-victim", LAYOUT, NUM_BLOCKS)) as victim:
        victim_md = victim.register()
        prefill.add_peer(victim_md)
        remote = victim.prepare_receive("gone", [1, 2, 3], 30.0)
        victim.kill()
        prefill.send("gone", [4, 5, 6], remote, 30.0)
        result = prefill.wait("gone")
        # UCX reports the vanished peer (NIXL_ERR_REMOTE_DISCONNECT): failed, not a timeout.
        assert result["state"] == "failed", result
        assert "REMOTE_DISCONNECT" in result["error"], result
        assert result["seconds"] < 2.0  # of a 30 s deadline
        assert prefill.releases()["gone"] == ["failed"]


@pytest.fixture(scope="module")
def big_pair():
    # UCX's tcp transport, as between two hosts without RDMA: on one host UCX otherwise
    # copies through shared memory inside the transfer call itself, leaving nothing to abort.
    with alarm_after(90), pytest.MonkeyPatch.context() as env:
        env.setenv("UCX_TLS", "tcp")
        sender = PeerProcess(PeerPlan("nixl", "nixl-big-prefill", BIG, BIG_BLOCKS, 0.3))
        receiver = PeerProcess(PeerPlan("nixl", "nixl-big-decode", BIG, BIG_BLOCKS, 0.3))
        sender_md, receiver_md = sender.register(), receiver.register()
        sender.add_peer(receiver_md)
        receiver.add_peer(sender_md)
    yield sender, receiver
    sender.stop()
    receiver.stop()


def test_abort_mid_transfer_ends_aborted_and_releases_once_fenced(big_pair):
    prefill, decode = big_pair
    blocks = list(range(BIG_BLOCKS))
    digest = prefill.fill(blocks, seed=5)
    remote = decode.prepare_receive("stop", blocks, 30.0)
    prefill.send("stop", blocks, remote, 30.0)
    prefill.abort("stop")  # 256 MiB in flight: the write cannot have finished yet
    sent = prefill.wait("stop")
    assert sent["state"] == "aborted", sent
    assert prefill.releases()["stop"] == ["aborted"]
    # The sender's stop notification reaches the receiver: failed, not done, not a timeout.
    received = decode.wait("stop")
    assert received["state"] == "failed", received
    assert received["error"] == "sender stopped before completing"
    # After the in-flight write (0.8 s calm; seconds on a loaded 2-core box), long before 30 s.
    assert received["seconds"] < 15.0
    assert decode.releases()["stop"] == ["failed"]
    # The pair still works afterwards: the next transfer lands bit-identical.
    remote = decode.prepare_receive("after", blocks, 30.0)
    prefill.send("after", blocks, remote, 30.0)
    assert prefill.wait("after")["state"] == decode.wait("after")["state"] == "done"
    assert decode.digest(blocks) == digest


def test_receiver_that_gives_up_waits_the_grace_period_for_a_silent_sender(pair):
    _, decode = pair
    decode.prepare_receive("silent", [5], 10.0)
    t0 = time.monotonic()
    decode.abort("silent")
    # No stop notification can come (nobody sent), so release waits out the 0.3 s grace.
    assert 0.25 < time.monotonic() - t0 < 2.0
    assert decode.releases()["silent"] == ["aborted"]
