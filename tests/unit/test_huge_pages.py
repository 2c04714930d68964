"""Large host buffers from an anonymous mapping: zeroed, writable, 2 MiB-aligned, equal to
what torch/numpy would have made."""

from __future__ import annotations

import numpy as np
import torch

from engine.hostmem import huge_pages
from engine.kvcache.pool import KVLayout, KVPool


def test_a_large_tensor_is_zeroed_aligned_and_writable():
    shape = (9, 1024, 1024)  # 18 MiB of fp16
    t = huge_pages.zeros_tensor(shape, torch.float16)
    assert t.shape == shape and t.dtype is torch.float16
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert not t.any()
    t[3, 5, 7] = 2.5
    assert t.sum().item() == 2.5


def test_small_buffers_stay_ordinary_allocations():
    t = huge_pages.zeros_tensor((4, 4), torch.float32)
    assert torch.equal(t, torch.zeros(4, 4))
    a = np.arange(10, dtype=np.int8)
    assert np.array_equal(huge_pages.copy_array(a), a)


def test_a_copied_array_equals_its_source_and_is_independent():
    src = np.random.default_rng(0).integers(-128, 127, (70000, 9, 32), dtype=np.int8)
    out = huge_pages.copy_array(src[:, 1:, :])  # a strided source
    assert out.flags.c_contiguous and out.dtype == np.int8
    assert np.array_equal(out, src[:, 1:, :])
    assert out.ctypes.data % huge_pages.HUGE_PAGE == 0
    out[0, 0, 0] = src[0, 1, 0] + 1 if src[0, 1, 0] < 127 else 0
    assert out[0, 0, 0] != src[0, 1, 0]


def test_a_large_kv_pool_reads_and_writes_blocks_as_before():
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16)
    pool = KVPool(layout, num_blocks=512)  # 32 MiB: on huge pages
    assert pool.tensor.data_ptr() % huge_pages.HUGE_PAGE == 0
    data = torch.randn(2, *layout.block_shape)
    pool.write_blocks([7, 300], data)
    assert torch.equal(pool.read_blocks([7, 300]), data)
    assert not pool.read_blocks([8]).any()
