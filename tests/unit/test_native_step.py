"""The native decode step (kernels/native) against the torch path it replaces.

Numerics: the native step computes with exactly the weights the fp32 build holds (the file's
blocks, dequantized the same way), so its logits must agree with torch's fp32 to float
rounding. Equivalence: greedy output through every engine path with the native decode path
equals the plain single-sequence run of the same model configuration.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.kvcache.pool import KVPool
from engine.model.llama import LlamaModel
from engine.model.native_step import NativeMatrix, NativeStep, NativeStepError, int8_kinds, repack
from engine.model.tiny import tiny_checkpoint, tiny_quantized_checkpoint
from kernels.attention_metadata import AttentionMetadata
from kernels.native import abi
from shared.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts(count: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 70))] for _ in range(count)]


@pytest.fixture(scope="module")
def split_model():
    """Prompt rows in torch fp32, decode rows natively (what `auto` picks on most CPUs)."""
    return LlamaModel(tiny_checkpoint(seed=0), weights="fp32", decode_weights="native")


@pytest.fixture(scope="module")
def native_model():
    return LlamaModel(tiny_checkpoint(seed=0), weights="native")


@pytest.fixture(scope="module")
def a8_split_model():
    """Prompt rows in torch fp32, decode rows natively with int8 activations, on the tiny
    model quantized to the bundled GGUF's block kinds (so the int8 kernels run)."""
    return LlamaModel(tiny_quantized_checkpoint(seed=0), weights="fp32", decode_weights="native-a8")


@pytest.fixture(scope="module")
def a8_model():
    return LlamaModel(tiny_quantized_checkpoint(seed=0), weights="native-a8")


@pytest.fixture(scope="module")
def quantized_split_model():
    """Like split_model, on the quantized tiny model: fp32 activations over Q4_1/Q8_0."""
    return LlamaModel(tiny_quantized_checkpoint(seed=0), weights="fp32", decode_weights="native")


def _engine(model, **overrides) -> Engine:
    cfg = dict(num_blocks=128, block_size=16, max_num_batched_tokens=512)
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg), model=model)


def _alone(model, prompts, **overrides) -> list[list[int]]:
    return [_engine(model, **overrides).generate([p], GREEDY)[0] for p in prompts]


# ---------------------------------------------------------------- kernels


def _q4_1_blocks(out: int, inp: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    blocks = np.zeros((out, inp // 32, 20), dtype=np.uint8)
    d = rng.uniform(0.001, 0.05, (out, inp // 32)).astype(np.float16)
    m = rng.uniform(-0.4, 0.0, (out, inp // 32)).astype(np.float16)
    blocks[..., 0:2] = d.view(np.uint8).reshape(out, inp // 32, 2)
    blocks[..., 2:4] = m.view(np.uint8).reshape(out, inp // 32, 2)
    blocks[..., 4:] = rng.integers(0, 256, (out, inp // 32, 16), dtype=np.uint8)
    return blocks


def _q4_1_dense(blocks: np.ndarray) -> torch.Tensor:
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
    return torch.from_numpy((q * d + m).reshape(blocks.shape[0], -1))


def _q8_0_blocks(out: int, inp: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    blocks = np.zeros((out, inp // 32, 34), dtype=np.uint8)
    d = rng.uniform(0.001, 0.05, (out, inp // 32)).astype(np.float16)
    blocks[..., 0:2] = d.view(np.uint8).reshape(out, inp // 32, 2)
    blocks[..., 2:] = rng.integers(-127, 128, (out, inp // 32, 32), dtype=np.int8).view(np.uint8)
    return blocks


def _q8_0_dense(blocks: np.ndarray) -> torch.Tensor:
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
    return torch.from_numpy((q * d).reshape(blocks.shape[0], -1))


class _Holder:
    """The least a NativeMatrix needs of its step: the library and a thread count."""

    def __init__(self, lib, threads: int):
        self.lib = lib
        self.threads = threads


@pytest.fixture(scope="module")
def native_lib():
    from kernels.native.build import load

    build = load()
    assert build.available, f"the native library did not build here: {build.reason}"
    return build.library


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 5, 9])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_quantized_matrix_equals_its_dequantized_fp32_product(native_lib, kind, rows, threads):
    out, inp = 37, 96  # odd output count: thread splits end mid-way
    make, dense_of, code = {
        "q4_1": (_q4_1_blocks, _q4_1_dense, abi.Q4_1),
        "q8_0": (_q8_0_blocks, _q8_0_dense, abi.Q8_0),
    }[kind]
    blocks = make(out, inp, seed=rows)
    quants, scales, mins = repack(code, blocks)
    linear = abi.Linear(
        code,
        out,
        inp,
        0,
        quants.ctypes.data,
        scales.ctypes.data,
        mins.ctypes.data if mins is not None else None,
    )
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows))
    got = NativeMatrix(_Holder(native_lib, threads), linear)(x)  # type: ignore[arg-type]
    want = x.double() @ dense_of(blocks).double().T
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


def _quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as linear_a8.h sees it: per 32 elements, d = max|x| / 127, x_q = round-half-even(x / d)."""
    rows, n = x.shape
    xb = x.reshape(rows, n // 32, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)
    return (torch.round(xb * inv).clamp(-127, 127) * d).reshape(rows, n)


def _linear(code: int, blocks: np.ndarray, tile: int = 16) -> abi.Linear:
    quants, scales, mins = repack(code, blocks, tile)
    linear = abi.Linear(
        code,
        blocks.shape[0],
        blocks.shape[1] * 32,
        0,
        quants.ctypes.data,
        scales.ctypes.data if scales is not None else None,
        mins.ctypes.data if mins is not None else None,
    )
    linear._arrays = (quants, scales, mins)  # type: ignore[attr-defined]  # kept alive
    return linear


# 576 = 4 groups of 4 blocks + a pair; 160 = a group + a single block; 96 = a pair + a single.
# 37 outputs: two whole 16-output tiles and a padded one.
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q4_1-tiles", "q8_0-tiles"])
@pytest.mark.parametrize("inp", [32, 96, 160, 576])
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_activation_matrix_equals_its_quantized_product(native_lib, kind, inp, threads):
    make, dense_of, code = {
        "q4_1": (_q4_1_blocks, _q4_1_dense, abi.Q4_1_A8),
        "q8_0": (_q8_0_blocks, _q8_0_dense, abi.Q8_0_A8),
        "q4_1-tiles": (_q4_1_blocks, _q4_1_dense, abi.Q4_1_A8_TILES),
        "q8_0-tiles": (_q8_0_blocks, _q8_0_dense, abi.Q8_0_A8_TILES),
    }[kind]
    q4_1_kind, q8_0_kind, tile = int8_kinds(native_lib)
    tiled = code in (abi.Q4_1_A8_TILES, abi.Q8_0_A8_TILES)
    if tiled and code not in (q4_1_kind, q8_0_kind):
        pytest.skip("this CPU's build has no such tiles (Q4_1 needs AVX2, Q8_0 AVX512-VNNI)")
    blocks = make(37, inp, seed=inp)
    matrix = NativeMatrix(_Holder(native_lib, threads), _linear(code, blocks, tile))  # type: ignore[arg-type]
    x = torch.randn(6, inp, generator=torch.Generator().manual_seed(inp))
    got = matrix(x)
    want = _quantized_activations(x.double()) @ dense_of(blocks).double().T
    # Integer dots are exact; what is left is fp32 rounding of the per-block scaling.
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    # ... and the activations really were quantized: fp32 inputs would not give this product.
    fp32 = x.double() @ dense_of(blocks).double().T
    assert (got.double() - fp32).abs().max().item() > 1e-3 * fp32.abs().max().item()
    for r in range(6):  # a row's result does not depend on the rows beside it
        assert torch.equal(matrix(x[r : r + 1])[0], got[r])


@pytest.mark.parametrize("flags", ["-O3 -mavx2 -mfma -mf16c", "-O3"], ids=["avx2", "scalar"])
def test_the_other_simd_paths_compute_the_same_products(flags, monkeypatch, tmp_path):
    """The AVX2 and plain-C paths (what an AVX2-only or non-x86 machine runs), built here."""
    from kernels.native.build import load

    monkeypatch.setenv("SPLITSERVE_NATIVE_CFLAGS", flags)
    build = load(tmp_path)
    assert build.available, build.reason
    holder = _Holder(build.library, 2)
    x = torch.randn(5, 160, generator=torch.Generator().manual_seed(7))
    for code, make, dense_of, quantized in (
        (abi.Q4_1, _q4_1_blocks, _q4_1_dense, False),
        (abi.Q8_0, _q8_0_blocks, _q8_0_dense, False),
        (abi.Q4_1_A8, _q4_1_blocks, _q4_1_dense, True),
        (abi.Q8_0_A8, _q8_0_blocks, _q8_0_dense, True),
    ):
        blocks = make(37, 160, seed=code)
        got = NativeMatrix(holder, _linear(code, blocks))(x).double()  # type: ignore[arg-type]
        inputs = _quantized_activations(x.double()) if quantized else x.double()
        want = inputs @ dense_of(blocks).double().T
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), code
    # AVX2 tiles Q4_1 in 8 outputs (and refuses Q8_0 tiles); plain C tiles nothing.
    q4_1_kind, q8_0_kind, tile = int8_kinds(build.library)
    avx2 = flags.startswith("-O3 -mavx2")
    want_kinds = (abi.Q4_1_A8_TILES, abi.Q8_0_A8, 8) if avx2 else (abi.Q4_1_A8, abi.Q8_0_A8, 0)
    assert (q4_1_kind, q8_0_kind, tile) == want_kinds
    blocks = _q4_1_blocks(37, 160, seed=1)
    tiles = NativeMatrix(holder, _linear(abi.Q4_1_A8_TILES, blocks, 8))  # type: ignore[arg-type]
    if tile:
        want = _quantized_activations(x.double()) @ _q4_1_dense(blocks).double().T
        got = tiles(x)
        assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
        for r in range(5):  # a row's result does not depend on the rows beside it
            assert torch.equal(tiles(x[r : r + 1])[0], got[r])
    else:
        with pytest.raises(NativeStepError):
            tiles(x)
    q8_tiles = _linear(abi.Q8_0_A8_TILES, _q8_0_blocks(37, 160, seed=1))
    with pytest.raises(NativeStepError):
        NativeMatrix(holder, q8_tiles)(x)  # type: ignore[arg-type]


def test_the_step_multiplies_int8_activations_in_this_builds_layout(native_lib):
    """The model's matrices take the tiles exactly where the build has them."""
    tile = native_lib.ss_a8_tiles()
    q8_0 = abi.Q8_0_A8_TILES if native_lib.ss_a8_q8_tiles() else abi.Q8_0_A8
    assert int8_kinds(native_lib) == (abi.Q4_1_A8_TILES if tile else abi.Q4_1_A8, q8_0, tile)
    assert tile in (0, 8, 16)


def test_a_matrix_with_ragged_blocks_is_refused(native_lib):
    quants = np.zeros((4, 1, 16), dtype=np.uint8)
    scales = np.zeros((4, 1), dtype=np.float32)
    bad = abi.Linear(abi.Q4_1, 4, 40, 0, quants.ctypes.data, scales.ctypes.data, None)
    x = torch.zeros(1, 40)
    y = torch.empty(1, 4)
    assert native_lib.ss_linear_forward(bad, x.data_ptr(), 1, y.data_ptr(), 1) == -1


# ---------------------------------------------------------------- the whole step


def _prefilled(
    model: LlamaModel, prompt: list[int], blocks: int = 16, dtype: torch.dtype = torch.float32
) -> tuple[KVPool, list]:
    pool = KVPool(model.kv_layout(16, dtype), blocks)
    table = list(range(blocks))
    n = len(prompt)
    model.forward(torch.tensor(prompt), AttentionMetadata([n], [n], [table], 16), pool)
    return pool, table


def _eager_and_native_step(model, dtype: torch.dtype = torch.float32):
    """A verify-shaped step (three new tokens of one prefilled sequence) through torch's
    attention and through the native step, each on its own copy of the same pool."""
    prompt = _prompts(1, seed=5)[0]
    pool, table = _prefilled(model, prompt, dtype=dtype)
    twin = KVPool(pool.layout, pool.num_blocks)
    twin.tensor.copy_(pool.tensor)
    n = len(prompt)
    tokens = [17, 99, 3]
    meta = AttentionMetadata([3], [n + 3], [table], 16)
    eager = model.logits(model.forward(torch.tensor(tokens), meta, pool, "fp32"))
    native = model.native
    assert native is not None
    args = (
        np.asarray(tokens, dtype=np.int64),
        np.arange(n, n + 3, dtype=np.int32),
        np.asarray([table] * 3, dtype=np.int32),
    )
    compiled = model.logits(native.forward(*args, twin.tensor, 16), decode=True)
    return eager, compiled, pool, twin, (prompt, args)


def test_native_step_equals_torch_eager_step_on_the_tiny_model(split_model):
    """The compiled step and the eager step give equal logits (<= 1e-4, fp32)."""
    eager, compiled, pool, twin, _ = _eager_and_native_step(split_model)
    assert (compiled - eager).abs().max().item() <= 1e-4
    # The new K/V landed in the same slots with the same values.
    assert (twin.tensor - pool.tensor).abs().max().item() <= 1e-4


def test_native_step_reads_and_writes_an_fp16_pool_like_the_torch_path(split_model):
    """An fp16 pool through the native step and through torch's attention: the same logits
    (both compute in fp32 over the same stored values), and the new K/V stored as torch
    rounds fp32 to fp16 (nearest even), bit for bit where the fp32 values are equal."""
    eager, compiled, pool, twin, (prompt, args) = _eager_and_native_step(split_model, torch.float16)
    assert (compiled - eager).abs().max().item() <= 1e-3
    # Layer 0's K/V of the new tokens depend on the embedding alone: same fp32 values on both
    # paths, so the same fp16 bits.
    assert torch.equal(twin.tensor[:, 0], pool.tensor[:, 0])
    fp32_pool, _ = _prefilled(split_model, prompt)
    fp32_pool_native = KVPool(fp32_pool.layout, fp32_pool.num_blocks)
    fp32_pool_native.tensor.copy_(fp32_pool.tensor)
    assert split_model.native is not None
    split_model.native.forward(*args, fp32_pool_native.tensor, 16)
    written = fp32_pool_native.tensor[:, 0].to(torch.float16)
    assert torch.equal(written, twin.tensor[:, 0])


@pytest.mark.parametrize("flags", ["-O3 -mavx2 -mfma -mf16c", "-O3"], ids=["avx2", "scalar"])
def test_the_other_simd_paths_read_and_write_fp16_kv_alike(
    split_model, flags, monkeypatch, tmp_path
):
    """The AVX2 and plain-C builds store fp16 K/V with the same bits as the build in use
    (round to nearest even, subnormals included) and read them to the same logits."""
    from kernels.native.build import load

    monkeypatch.setenv("SPLITSERVE_NATIVE_CFLAGS", flags)
    other = load(tmp_path)
    assert other.available, other.reason
    native = split_model.native
    assert native is not None
    prompt = _prompts(1, seed=11)[0]
    pool, table = _prefilled(split_model, prompt, dtype=torch.float16)
    n = len(prompt)
    args = (
        np.asarray([17, 99], dtype=np.int64),
        np.arange(n, n + 2, dtype=np.int32),
        np.asarray([table] * 2, dtype=np.int32),
    )
    here = KVPool(pool.layout, pool.num_blocks)
    here.tensor.copy_(pool.tensor)
    want = native.forward(*args, here.tensor, 16)
    there = KVPool(pool.layout, pool.num_blocks)
    there.tensor.copy_(pool.tensor)
    saved = native.lib
    native.lib = other.library
    try:
        got = native.forward(*args, there.tensor, 16)
    finally:
        native.lib = saved
    assert (got - want).abs().max().item() <= 1e-4
    assert torch.equal(there.tensor[:, 0], here.tensor[:, 0])


@pytest.mark.parametrize(
    "flags", [None, "-O3 -mavx2 -mfma -mf16c", "-O3"], ids=["here", "avx2", "scalar"]
)
def test_fp16_conversions_match_torch_bit_for_bit(flags, monkeypatch, tmp_path):
    """Every finite half converts to the float torch gives, and floats round to half as torch
    rounds them (nearest even: ties, subnormals, overflow to infinity) in every build."""
    from kernels.native.build import load

    if flags is not None:
        monkeypatch.setenv("SPLITSERVE_NATIVE_CFLAGS", flags)
    build = load(tmp_path if flags is not None else None)
    assert build.available, build.reason
    lib = build.library
    halves = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    halves = halves[~torch.isnan(halves)].contiguous()
    floats = torch.empty(halves.shape, dtype=torch.float32)
    assert lib.ss_load_half(halves.data_ptr(), halves.numel(), floats.data_ptr()) == 0
    assert torch.equal(floats, halves.float())
    rng = torch.Generator().manual_seed(3)
    edge = torch.tensor(
        [
            1.0 + 2**-11,
            1.0 + 3 * 2**-11,
            2**-20,
            -1.5 * 2**-24,
            2**-25,
            65504.0,
            65519.0,
            65520.0,
            -70000.0,
            1e-30,
            -0.0,
            float("inf"),
        ]
    )
    values = torch.cat(
        [
            edge,
            torch.randn(4096, generator=rng) * 10.0 ** torch.randint(-9, 5, (4096,), generator=rng),
        ]
    )
    values = values.float().contiguous()
    stored = torch.empty(values.shape, dtype=torch.float16)
    assert lib.ss_store_half(values.data_ptr(), values.numel(), stored.data_ptr()) == 0
    assert torch.equal(stored.view(torch.int16), values.to(torch.float16).view(torch.int16))


def test_a_row_is_computed_the_same_whatever_shares_its_step(split_model):
    native = split_model.native
    assert native is not None
    prompts = _prompts(3, seed=9)
    pools = []
    for prompt in prompts:
        pool, _ = _prefilled(split_model, prompt)
        pools.append(pool)
    # One pool holding all three sequences' blocks side by side.
    joint = KVPool(pools[0].layout, 48)
    for i, pool in enumerate(pools):
        joint.tensor[i * 16 : (i + 1) * 16] = pool.tensor
    tables = [list(range(i * 16, (i + 1) * 16)) for i in range(3)]
    positions = [len(p) for p in prompts]
    together = native.forward(
        np.asarray([5, 6, 7], dtype=np.int64),
        np.asarray(positions, dtype=np.int32),
        np.asarray(tables, dtype=np.int32),
        joint.tensor,
        16,
    )
    alone = native.forward(
        np.asarray([6], dtype=np.int64),
        np.asarray([positions[1]], dtype=np.int32),
        np.asarray([tables[1]], dtype=np.int32),
        joint.tensor,
        16,
    )
    assert torch.equal(together[1], alone[0])  # bit for bit, not merely close


def test_bad_positions_are_refused_not_read_out_of_bounds(split_model):
    native = split_model.native
    assert native is not None
    pool = KVPool(split_model.kv_layout(16), 2)
    with pytest.raises(RuntimeError, match="refused"):
        native.forward(
            np.asarray([1], dtype=np.int64),
            np.asarray([40], dtype=np.int32),  # position 40 needs a third block
            np.asarray([[0, 1]], dtype=np.int32),
            pool.tensor,
            16,
        )


def test_no_compiler_means_no_native_step_and_a_reason(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_NATIVE", "0")
    ck = tiny_checkpoint(seed=0)
    model = LlamaModel(ck, weights="fp32")
    step, reason = NativeStep.create(ck, model.embed_tokens, model.rope.cos, model.rope.sin)
    assert step is None and "SPLITSERVE_NATIVE=0" in reason
    from engine.model.llama import NativeUnavailable

    with pytest.raises(NativeUnavailable, match="SPLITSERVE_NATIVE"):
        LlamaModel(ck, weights="native")


# ---------------------------------------------------------------- engine paths


ENGINE_PATHS = [
    (model, kv)
    for model in ("split", "q-split", "native", "a8-split", "a8")
    for kv in ("float32", "float16")
]


@pytest.fixture(scope="module", params=ENGINE_PATHS, ids=[f"{m}-{kv}" for m, kv in ENGINE_PATHS])
def model_and_alone(
    request, split_model, quantized_split_model, native_model, a8_split_model, a8_model
):
    """A model build and KV element type, with each prompt's plain single-sequence output
    under the same build and KV type (fp16 KV is part of the configuration, like the format)."""
    name, kv = request.param
    model = {
        "split": split_model,
        "q-split": quantized_split_model,
        "native": native_model,
        "a8-split": a8_split_model,
        "a8": a8_model,
    }[name]
    return model, kv, _alone(model, _prompts(8), kv_cache_dtype=kv)


def test_one_model_holds_one_native_build():
    with pytest.raises(ValueError, match="one native build"):
        LlamaModel(tiny_checkpoint(seed=0), weights="native", decode_weights="native-a8")


def test_int8_activations_change_the_logits_a_little(quantized_split_model, a8_split_model):
    """native-a8 is its own (gated) build: close to fp32, not equal to it."""
    split_model = quantized_split_model
    prompt = _prompts(1, seed=5)[0]
    pool, table = _prefilled(split_model, prompt)
    n = len(prompt)
    args = (
        np.asarray([17], dtype=np.int64),
        np.asarray([n], dtype=np.int32),
        np.asarray([table], dtype=np.int32),
    )
    twin = KVPool(pool.layout, pool.num_blocks)
    twin.tensor.copy_(pool.tensor)
    fp32 = split_model.logits(split_model.native.forward(*args, pool.tensor, 16), decode=True)
    a8 = a8_split_model.logits(a8_split_model.native.forward(*args, twin.tensor, 16), decode=True)
    diff = (a8 - fp32).abs().max().item()
    assert 1e-6 < diff < 0.1 * fp32.abs().max().item()


def test_batch_of_eight_equals_each_alone(model_and_alone):
    model, kv, alone = model_and_alone
    engine = _engine(model, kv_cache_dtype=kv)
    assert engine.generate(_prompts(8), GREEDY) == alone
    engine.blocks.check_integrity()


@pytest.mark.parametrize("chunk", [1, 7, 33])
def test_chunked_prefill_equals_unchunked(model_and_alone, chunk):
    model, kv, alone = model_and_alone
    engine = _engine(model, kv_cache_dtype=kv, max_num_batched_tokens=chunk)
    assert engine.generate(_prompts(8), GREEDY) == alone
    engine.blocks.check_integrity()


def test_cached_prefix_equals_fresh(model_and_alone):
    model, kv, alone = model_and_alone
    engine = _engine(model, kv_cache_dtype=kv)
    prompt = _prompts(8)[3]
    assert engine.generate([prompt], GREEDY) == [alone[3]]
    engine.add_request(prompt, GREEDY)
    outs = list(engine.run_until_done())
    assert [t for o in outs for t in o.new_token_ids] == alone[3]
    assert outs[0].num_cached_tokens == (len(prompt) - 1) // 16 * 16 > 0
    engine.blocks.check_integrity()


@pytest.mark.parametrize("method", ["ngram", "adaptive"])
def test_speculative_decoding_equals_plain(model_and_alone, method):
    model, kv, alone = model_and_alone
    engine = _engine(model, kv_cache_dtype=kv, speculative_method=method, num_speculative_tokens=4)
    assert engine.generate(_prompts(8), GREEDY) == alone
    engine.blocks.check_integrity()


def _real_model_step(real_model, native: LlamaModel, prompt: list[int], kv_dtype: torch.dtype):
    """Two new tokens after `prompt` through torch's attention and through the native step,
    each on its own copy of the same prefilled pool: (native logits, torch logits)."""
    pool, table = _prefilled(real_model, prompt, blocks=len(prompt) // 16 + 2, dtype=kv_dtype)
    twin = KVPool(pool.layout, pool.num_blocks)
    twin.tensor.copy_(pool.tensor)
    n = len(prompt)
    meta = AttentionMetadata([2], [n + 2], [table], 16)
    want = real_model.logits(real_model.forward(torch.tensor([42, 7]), meta, pool))
    assert native.native is not None
    hidden = native.native.forward(
        np.asarray([42, 7], dtype=np.int64),
        np.asarray([n, n + 1], dtype=np.int32),
        np.asarray([table] * 2, dtype=np.int32),
        twin.tensor,
        16,
    )
    return native.logits(hidden, decode=True), want


@pytest.mark.real_model
def test_native_step_matches_fp32_on_the_real_model(real_checkpoint, real_model):
    """The bundled GGUF through the native step: logits agree with the fp32 build's."""
    native = LlamaModel(real_checkpoint, weights="native")
    got, want = _real_model_step(real_model, native, [1, *range(300, 340)], torch.float32)
    assert (got - want).abs().max().item() <= 1e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.real_model
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["fp32-kv", "fp16-kv"])
@pytest.mark.parametrize("flags", ["-O3 -mavx2 -mfma -mf16c", "-O3"], ids=["avx2", "scalar"])
@pytest.mark.parametrize("context", [101, 203], ids=["one-split", "three-splits"])
def test_the_other_builds_attend_alike_on_the_real_model(
    real_checkpoint, real_model, kv_dtype, flags, context, monkeypatch, tmp_path
):
    """The AVX2 and plain-C builds' attention at the real head size (64), whose AVX2 path
    widens each block's rows once and reduces eight dots together: the same logits as torch's
    attention over a context of whole and partial blocks. 101 tokens (six whole blocks and a
    partial one) fit one split; over 3 threads 203 tokens are split at positions 67 and 135,
    mid-block (the AVX2 build once skipped the V rows after a mid-block split start up to
    the next block: garbage replies past 128 tokens of context on every AVX2-only machine)."""
    from kernels.native.build import load

    monkeypatch.setenv("SPLITSERVE_NATIVE_CFLAGS", flags)
    other = load(tmp_path)
    assert other.available, other.reason
    native = LlamaModel(real_checkpoint, weights="native")  # row-major kinds: any build reads them
    assert native.native is not None
    native.native.lib = other.library
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # the native step takes torch's thread count per call
    try:
        got, want = _real_model_step(real_model, native, [1, *range(300, 299 + context)], kv_dtype)
    finally:
        torch.set_num_threads(threads)
    # Summation order alone: 30 layers of fp32 rounding, logits of magnitude ~25. The builds
    # sum the linears in another order than the BLAS too: the AVX2 build with an fp16 pool over
    # three splits was 2.0e-4 of the largest logit off on an AVX-512 EPYC (MKL's AVX-512
    # kernels), within 1e-4 on AVX2 machines; the bug this guards against gave garbage.
    assert (got - want).abs().max().item() <= 5e-4 * want.abs().max().item()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
