"""tcp and shm backends between real OS processes: exact bytes, and every way a transfer
can end badly (peer killed mid-transfer, deadline, abort) ends in a terminal state with the
blocks released once on every surviving side.

"Mid-transfer" is made deterministic: for tcp the doomed peer gets 4 KiB socket buffers, so
64 MiB take seconds and the kill lands once some blocks (but not all) went over the wire;
for shm, whose copy is one fast memcpy, the reader is SIGSTOPped before it starts.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

import pytest
import torch

from engine.kvcache.pool import KVLayout
from services.kvtransfer.types import AgentMetadata, BlockDescriptor, ReceiveDescriptors
from tools.bench.transfer_peer import PeerPlan, PeerProcess, alarm_after

# 1 MiB blocks; 64 of them outgrow loopback socket buffers many times over.
LAYOUT = KVLayout(num_layers=32, num_kv_heads=4, head_dim=128, block_size=16, dtype=torch.bfloat16)
NUM_BLOCKS = 72
BIG = list(range(63, -1, -1))  # descending: 64 separate 1 MiB runs, no coalescing
GRACE_S = 0.5


@pytest.fixture(autouse=True)
def _hard_timeout():
    with alarm_after(90):
        yield


@dataclass
class Pair:
    kind: str
    prefill: PeerProcess
    decode: PeerProcess
    prefill_md: AgentMetadata
    decode_md: AgentMetadata


def plan(kind: str, name: str, options: dict | None = None) -> PeerPlan:
    return PeerPlan(kind, f"{name}-{kind}", LAYOUT, NUM_BLOCKS, GRACE_S, options or {})


@pytest.fixture(scope="module", params=["tcp", "shm"])
def pair(request):
    kind = request.param
    with alarm_after(90):
        prefill, decode = PeerProcess(plan(kind, "prefill")), PeerProcess(plan(kind, "decode"))
        prefill_md, decode_md = prefill.register(), decode.register()
        prefill.add_peer(decode_md)
        decode.add_peer(prefill_md)
    yield Pair(kind, prefill, decode, prefill_md, decode_md)
    prefill.stop()
    decode.stop()


def stay_pending(peer: PeerProcess, rid: str, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert peer.poll(rid) == "pending"
        time.sleep(0.05)


def test_blocks_arrive_bit_identical(pair):
    src, dst = [3, 40, 41, 42, 7, 70], [9, 10, 11, 0, 55, 56]
    digest = pair.prefill.fill(src, seed=11)
    untouched = [i for i in range(NUM_BLOCKS) if i not in dst]
    before = pair.decode.digest(untouched)
    remote = pair.decode.prepare_receive("copy", dst, 10.0)
    pair.prefill.send("copy", src, remote, 8.0)
    assert pair.prefill.wait("copy")["state"] == "done"
    received = pair.decode.wait("copy")
    assert received["state"] == "done"
    assert received["nbytes"] == len(dst) * LAYOUT.block_bytes
    assert pair.decode.digest(dst) == digest
    assert pair.decode.digest(untouched) == before
    assert pair.prefill.releases()["copy"] == ["done"]
    assert pair.decode.releases()["copy"] == ["done"]


def test_receiver_times_out_when_nobody_sends(pair):
    pair.decode.prepare_receive("nobody", [1, 2], 0.3)
    assert pair.decode.wait("nobody")["state"] == "timed_out"
    assert pair.decode.releases()["nobody"] == ["timed_out"]


def test_transfer_for_an_unprepared_request_is_refused(pair):
    block = BlockDescriptor(5, 5 * LAYOUT.block_bytes, LAYOUT.block_bytes)
    fake = ReceiveDescriptors("unprepared", pair.decode.plan.agent_name, (block,))
    pair.prefill.send("unprepared", [5], fake, 5.0)
    result = pair.prefill.wait("unprepared")
    assert result["state"] == "failed"
    assert "no transfer prepared for request 'unprepared'" in result["error"]
    assert pair.prefill.releases()["unprepared"] == ["failed"]


def wait_until_moving(peer: PeerProcess, rid: str) -> None:
    """Until at least one block went over the wire (the tcp peers here have tiny buffers,
    so the rest takes seconds)."""
    end = time.monotonic() + 20.0
    while peer.moved_bytes(rid) == 0:
        assert peer.poll(rid) == "pending" and time.monotonic() < end
        time.sleep(0.01)


def test_receiver_killed_mid_transfer(pair):
    slow = {"socket_buffer_bytes": 4096} if pair.kind == "tcp" else {}
    with PeerProcess(plan(pair.kind, "doomed-decode", slow)) as victim:
        victim_md = victim.register()
        victim.add_peer(pair.prefill_md)
        pair.prefill.add_peer(victim_md)
        remote = victim.prepare_receive("victim", BIG, 30.0)
        if pair.kind == "shm":
            victim.signal(signal.SIGSTOP)  # its copy is one fast memcpy: catch it before
        pair.prefill.send("victim", BIG, remote, 30.0)
        if pair.kind == "tcp":
            wait_until_moving(pair.prefill, "victim")
        else:
            stay_pending(pair.prefill, "victim", 0.3)
        victim.kill()
        t0 = time.monotonic()
        result = pair.prefill.wait("victim")
        assert result["state"] == "failed", result
        assert time.monotonic() - t0 < 5.0
        if pair.kind == "tcp":
            assert 0 < result["moved"] < len(BIG) * LAYOUT.block_bytes
        assert pair.prefill.releases()["victim"] == ["failed"]


def test_sender_killed_mid_transfer(pair):
    slow = {"socket_buffer_bytes": 4096} if pair.kind == "tcp" else {}
    with PeerProcess(plan(pair.kind, "doomed-prefill", slow)) as victim:
        victim_md = victim.register()
        victim.add_peer(pair.decode_md)
        pair.decode.add_peer(victim_md)
        before = pair.decode.digest(BIG)
        victim.fill(BIG, seed=9)
        remote = pair.decode.prepare_receive("orphan", BIG, 30.0)
        if pair.kind == "shm":
            pair.decode.signal(signal.SIGSTOP)
        victim.send("orphan", BIG, remote, 30.0)
        if pair.kind == "tcp":
            wait_until_moving(victim, "orphan")
        else:
            stay_pending(victim, "orphan", 0.3)
        victim.kill()
        pair.decode.signal(signal.SIGCONT)
        result = pair.decode.wait("orphan")
        assert result["state"] == "failed", result
        assert "broke" in result["error"]
        assert pair.decode.releases()["orphan"] == ["failed"]
        if pair.kind == "tcp":
            assert 0 < result["moved"] < len(BIG) * LAYOUT.block_bytes
        else:  # decode saw the hang-up before its first chunk
            assert pair.decode.digest(BIG) == before


def test_sender_deadline_against_a_stalled_receiver(pair):
    remote = pair.decode.prepare_receive("stall", BIG, 30.0)
    pair.decode.signal(signal.SIGSTOP)
    try:
        pair.prefill.send("stall", BIG, remote, 0.5)
        t0 = time.monotonic()
        assert pair.prefill.wait("stall")["state"] == "timed_out"
        # tcp stops at once; shm also waits out the fence grace for the stopped reader.
        assert time.monotonic() - t0 < 0.5 + GRACE_S + 1.0
        assert pair.prefill.releases()["stall"] == ["timed_out"]
    finally:
        pair.decode.signal(signal.SIGCONT)
    assert pair.decode.wait("stall")["state"] == "failed"
    assert pair.decode.releases()["stall"] == ["failed"]


def test_abort_mid_transfer_is_fenced_and_frees_both_sides(pair):
    dst = BIG[:8]
    before = pair.decode.digest(dst)
    pair.prefill.fill(dst, seed=5)
    remote = pair.decode.prepare_receive("cancel", dst, 30.0)
    pair.decode.signal(signal.SIGSTOP)
    try:
        pair.prefill.send("cancel", dst, remote, 30.0)
        stay_pending(pair.prefill, "cancel", 0.2)
        t0 = time.monotonic()
        pair.prefill.abort("cancel")
        took = time.monotonic() - t0
        assert pair.prefill.releases()["cancel"] == ["aborted"]
    finally:
        pair.decode.signal(signal.SIGCONT)
    if pair.kind == "tcp":
        # A pushing sender touches only its own memory: released without waiting on decode.
        assert took < GRACE_S
    else:
        # Decode reads the prefill's memory, so prefill waits for it to hang up: here the
        # whole grace period, decode being stopped.
        assert GRACE_S - 0.1 < took < GRACE_S + 1.5
    assert pair.decode.wait("cancel")["state"] == "failed"
    assert pair.decode.releases()["cancel"] == ["failed"]
    if pair.kind == "shm":  # once running, decode saw the hang-up and copied nothing
        assert pair.decode.digest(dst) == before
