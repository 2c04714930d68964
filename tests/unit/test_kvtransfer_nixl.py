"""The NIXL (UCX) backend: two real processes on loopback, plus its stop/fence protocol.

Skipped only when ``nixl`` cannot be imported; the construction error is tested always.
NIXL is only ever loaded in the child processes: its bundled protobuf/abseil libraries crash
a process that also loads grpc_tools' protoc extension, and the test process may.
"""

from __future__ import annotations

import sys
import time

import pytest
import torch

from services.kvtransfer.nixl import NixlTransferBackend, NixlUnavailableError, nixl_import_error
from services.kvtransfer.peer_process import PeerProcess, PeerSpec, alarm_after
from shared.kvcache.pool import KVLayout

NIXL_IMPORT_ERROR = nixl_import_error()

needs_nixl = pytest.mark.skipif(
    bool(NIXL_IMPORT_ERROR), reason=f"nixl is not importable: {NIXL_IMPORT_ERROR}"
)

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=torch.float16)
NUM_BLOCKS = 40


@pytest.fixture(autouse=True)
def _hard_timeout():
    with alarm_after(90):
        yield


def test_missing_nixl_is_a_clear_construction_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl._api", None)  # makes the import raise ImportError
    with pytest.raises(NixlUnavailableError, match="needs the `nixl` package"):
        NixlTransferBackend("nowhere")


@pytest.fixture(scope="module")
def pair():
    if NIXL_IMPORT_ERROR:
        pytest.skip(f"nixl is not importable: {NIXL_IMPORT_ERROR}")
    with alarm_after(90):
        prefill = PeerProcess(PeerSpec("nixl", "nixl-prefill", LAYOUT, NUM_BLOCKS, 0.3))
        decode = PeerProcess(PeerSpec("nixl", "nixl-decode", LAYOUT, NUM_BLOCKS, 0.3))
        pre_md, dec_md = prefill.register(), decode.register()
        prefill.add_peer(dec_md)
        decode.add_peer(pre_md)
    yield prefill, decode
    prefill.stop()
    decode.stop()


@needs_nixl
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


@needs_nixl
def test_receiver_times_out_when_nobody_sends(pair):
    _, decode = pair
    decode.prepare_receive("nixl-nobody", [1], 0.2)
    assert decode.wait("nixl-nobody")["state"] == "timed_out"
    assert decode.releases()["nixl-nobody"] == ["timed_out"]


@needs_nixl
def test_receiver_killed_sender_fails_fast(pair):
    prefill, _ = pair
    with PeerProcess(PeerSpec("nixl", "nixl-victim", LAYOUT, NUM_BLOCKS)) as victim:
        victim_md = victim.register()
        prefill.add_peer(victim_md)
        remote = victim.prepare_receive("gone", [1, 2, 3], 10.0)
        victim.kill()
        prefill.send("gone", [4, 5, 6], remote, 3.0)
        result = prefill.wait("gone")
        assert result["state"] in ("failed", "timed_out"), result
        assert result["seconds"] < 4.0
        assert prefill.releases()["gone"] == [result["state"]]


@needs_nixl
def test_sender_abort_reaches_the_receiver_as_a_stop(pair):
    prefill, decode = pair
    remote = decode.prepare_receive("stop", [1, 2], 10.0)
    prefill.send("stop", [3, 4], remote, 10.0)
    prefill.abort("stop")  # may land after the write completed; then the receiver sees DONE
    state = decode.wait("stop")["state"]
    assert state in ("failed", "done")
    # The abort races a two-block write on loopback: if the write already completed, the
    # sender's outcome is DONE; either way its blocks are released exactly once.
    assert prefill.releases()["stop"] in (["aborted"], ["done"])
    assert decode.releases()["stop"] == [state]


@needs_nixl
def test_receiver_that_gives_up_waits_the_grace_period_for_a_silent_sender(pair):
    _, decode = pair
    decode.prepare_receive("silent", [5], 10.0)
    t0 = time.monotonic()
    decode.abort("silent")
    # No stop notification can come (nobody sent), so release waits out the 0.3 s grace.
    assert 0.25 < time.monotonic() - t0 < 2.0
    assert decode.releases()["silent"] == ["aborted"]
