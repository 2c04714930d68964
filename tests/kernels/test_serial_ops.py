"""kernels/serial_ops.py: torch ops inside run on one thread, the count comes back after, and
the ops the decoder runs inside it give the same bits on one thread as on two."""

from __future__ import annotations

import pytest
import torch

from engine.model.layers import rms_norm
from engine.model.rope import RotaryEmbedding
from kernels.moe_experts import activate
from kernels.serial_ops import SERIAL_MAX_ROWS, serial_ops


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_one_thread_inside_and_the_count_restored(two_threads):
    with serial_ops(SERIAL_MAX_ROWS):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), serial_ops(8):
        raise RuntimeError("a failing op")
    assert torch.get_num_threads() == 2


def test_a_prefill_chunk_keeps_both_threads(two_threads):
    # Past SERIAL_MAX_ROWS the second thread pays for its wake-up (512 rows: 6.8 against
    # 8.9 ms a layer on one).
    with serial_ops(SERIAL_MAX_ROWS + 1):
        assert torch.get_num_threads() == 2


def test_already_one_thread_stays_one():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with serial_ops(8):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 9, 72])
def test_decoder_ops_same_bits_on_one_thread(two_threads, rows):
    # 72 rows put every op past torch's grain size (32,768 elements), where two threads
    # split it: the case serial_ops changes.
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g)
    w = torch.randn(576, generator=g)
    qk = torch.randn(rows, 12, 64, generator=g)
    cos, sin = torch.randn(rows, 1, 64, generator=g), torch.randn(rows, 1, 64, generator=g)
    gu = torch.randn(rows, 3072, generator=g)

    def ops():
        return (
            rms_norm(x, w, 1e-5),
            RotaryEmbedding.apply(qk, cos, sin),
            activate(gu[:, :1536], "silu") * gu[:, 1536:],
        )

    spread = ops()
    with serial_ops(rows):
        alone = ops()
    for a, b in zip(spread, alone, strict=True):
        assert torch.equal(a, b)
