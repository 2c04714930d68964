"""Byte-level pieces: the stream protocol's frames, block runs, and the shared-memory pool."""

from __future__ import annotations

import socket

import pytest
import torch

from engine.kvcache.pool import KVLayout
from services.kvtransfer import wire
from services.kvtransfer.blockbytes import Run, byte_view, copy_runs, runs
from services.kvtransfer.shm_pool import SharedKVPool

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=2, dtype=torch.bfloat16)


def test_request_and_ack_round_trip_over_a_socket():
    req = wire.TransferRequest(wire.Kind.PUSH, "req-é", "prefill-0", 4096, (7, 8, 1), (0, 1, 2))
    a, b = socket.socketpair()
    with a, b:
        a.sendall(wire.encode_request(req) + wire.encode_ack(False, "no room"))
        assert wire.read_request(b) == req
        assert wire.read_ack(b) == (False, "no room")
    assert req.payload_bytes == 3 * 4096


def test_garbage_and_truncation_are_protocol_errors():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 64)
        with pytest.raises(wire.ProtocolError, match="magic"):
            wire.read_request(b)
    a, b = socket.socketpair()
    with b:
        a.sendall(
            wire.encode_request(wire.TransferRequest(wire.Kind.PULL, "r", "s", 16, (1,), (2,)))[:10]
        )
        a.close()
        with pytest.raises(ConnectionError, match="after 10 of"):
            wire.read_request(b)


def test_runs_coalesce_only_blocks_consecutive_on_both_sides():
    assert runs([4, 5, 6, 9, 10], [0, 1, 7, 8, 9]) == [Run(4, 0, 2), Run(6, 7, 1), Run(9, 8, 2)]
    assert runs([3], [3]) == [Run(3, 3, 1)]


def test_copy_runs_moves_exact_bytes_and_stops_when_cancelled():
    src = torch.randint(0, 256, (10 * 64,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    copy_runs(src, dst, [1, 2, 9], [5, 6, 0], 64)
    assert torch.equal(dst[5 * 64 : 7 * 64], src[64 : 3 * 64])
    assert torch.equal(dst[:64], src[9 * 64 :])
    assert int(dst[64 : 5 * 64].count_nonzero()) == 0
    with pytest.raises(InterruptedError):
        copy_runs(src, torch.zeros_like(src), [0], [1], 64, keep_going=lambda: False)


def test_shared_pool_is_one_memory_seen_by_two_mappings(tmp_path):
    pool = SharedKVPool.create(LAYOUT, 6, directory=tmp_path)
    assert pool.tensor.shape == (6, *LAYOUT.block_shape)
    assert int(pool.tensor.count_nonzero()) == 0
    mapped = SharedKVPool.attach(pool.path, LAYOUT, 6)
    pool.tensor[3].fill_(1.5)
    assert torch.equal(mapped.block_view(3), pool.block_view(3))
    assert byte_view(mapped.tensor).data_ptr() != byte_view(pool.tensor).data_ptr()
    with pytest.raises(ValueError, match="holds"):
        SharedKVPool.attach(pool.path, LAYOUT, 7)
    pool.unlink()
    assert not pool.path.exists()
    mapped.tensor[0].fill_(2.0)  # mappings outlive the name
    assert float(pool.tensor[0].flatten()[0]) == 2.0
