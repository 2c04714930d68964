"""A greedy row's token through the head's int8 twin (engine/model/greedy_head.py) is the full
exact logits' argmax, ties and near-ties included, and the engine takes it only for rows that
read nothing else from their logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.model import greedy_head
from engine.model.greedy_head import GreedyHead
from engine.model.llama import LlamaModel
from engine.model.native_step import NativeMatrix, int8_kinds, repack
from engine.model.tiny import tiny_quantized_checkpoint
from kernels.native import abi
from kernels.native.build import load
from shared.sampling.params import SamplingParams

VOCAB, HIDDEN = 3000, 160


@pytest.fixture(scope="module")
def lib():
    build = load()
    assert build.available, f"the native library did not build here: {build.reason}"
    return build.library


class _Holder:
    def __init__(self, lib, threads: int):
        self.lib = lib
        self.threads = threads


def _blocks(seed: int) -> np.ndarray:
    """A Q8_0 head as the file holds it [vocab, blocks, 34], with planted ties: outputs 17
    and 2999 repeat output 5 exactly, and output 9 is output 5 with one quant one step off."""
    rng = np.random.default_rng(seed)
    blocks = np.zeros((VOCAB, HIDDEN // 32, 34), dtype=np.uint8)
    d = rng.uniform(0.001, 0.05, (VOCAB, HIDDEN // 32)).astype(np.float16)
    blocks[..., 0:2] = d.view(np.uint8).reshape(VOCAB, HIDDEN // 32, 2)
    blocks[..., 2:] = rng.integers(-127, 128, (VOCAB, HIDDEN // 32, 32), dtype=np.int8).view(
        np.uint8
    )
    blocks[17] = blocks[5]
    blocks[2999] = blocks[5]
    blocks[9] = blocks[5]
    q = blocks[9, 1, 2 + 3 : 2 + 4].view(np.int8)
    q[0] = q[0] - 1 if q[0] > -127 else q[0] + 1
    return blocks


def _head(lib, blocks: np.ndarray, threads: int = 2) -> tuple[GreedyHead, NativeMatrix]:
    quants, scales, _ = repack(abi.Q8_0, blocks)
    quants = np.ascontiguousarray(quants.reshape(VOCAB, HIDDEN // 32, 32))
    _, q8_kind, tile = int8_kinds(lib)
    packed = repack(q8_kind, blocks, tile or 16)
    keep = [a for a in packed if a is not None]
    twin = abi.Linear(
        q8_kind,
        VOCAB,
        HIDDEN,
        0,
        packed[0].ctypes.data,
        packed[1].ctypes.data if packed[1] is not None else None,
        packed[2].ctypes.data if packed[2] is not None else None,
    )
    head = GreedyHead(lib, quants, scales, twin, lambda: threads)
    head._keep = keep  # type: ignore[attr-defined]  # the twin's arrays live with it
    exact = abi.Linear(abi.Q8_0, VOCAB, HIDDEN, 0, quants.ctypes.data, scales.ctypes.data, None)
    return head, NativeMatrix(_Holder(lib, threads), exact)  # type: ignore[arg-type]


def _dense(blocks: np.ndarray) -> torch.Tensor:
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
    return torch.from_numpy((q * d).reshape(VOCAB, HIDDEN))


@pytest.mark.parametrize("threads", [1, 2])
def test_the_twin_finds_the_full_logits_argmax_ties_and_near_ties_included(lib, threads):
    blocks = _blocks(seed=threads)
    head, exact = _head(lib, blocks, threads)
    g = torch.Generator().manual_seed(threads)
    dense = _dense(blocks)
    rows = [
        torch.randn(40, HIDDEN, generator=g),  # ordinary rows
        torch.randn(40, HIDDEN, generator=g) * 30,  # wide ones
        torch.randn(40, HIDDEN, generator=g) * 0.01,  # flat logits: many near the top
        # Aimed at output 5: 5, 17 and 2999 tie exactly, 9 differs in one product.
        dense[5] * 40 + torch.randn(20, HIDDEN, generator=g) * 0.01,
    ]
    for x in rows:
        for count in (1, 3, 9, 20):
            part = x[:count].contiguous()
            want = exact(part).argmax(dim=-1)
            assert torch.equal(head.argmax(part), want)
    aimed = dense[5] * 40
    logits = exact(aimed[None])[0]
    assert logits[5] == logits[17] == logits[2999] == logits.max()  # a real tie ...
    assert head.argmax(aimed[None]).item() == 5  # ... and the first of it wins


def test_non_finite_or_huge_inputs_take_the_full_logits(lib):
    head, exact = _head(lib, _blocks(seed=3))
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(3))
    x[1, 7] = float("nan")
    x[2, 3] = float("inf")
    x[3] *= 1e7  # past FINITE_LIMIT: no bound is claimed
    assert torch.equal(head.argmax(x), exact(x).argmax(dim=-1))


def test_each_row_bucket_times_both_paths_then_keeps_one(lib, monkeypatch):
    head, exact = _head(lib, _blocks(seed=4))
    calls = {"twin": 0, "full": 0}
    twin_argmax = head.argmax

    def counted_twin(hidden):
        calls["twin"] += 1
        return twin_argmax(hidden)

    def full(hidden):
        calls["full"] += 1
        return exact(hidden).argmax(dim=-1)

    monkeypatch.setattr(head, "argmax", counted_twin)
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(4))
    want = exact(x).argmax(dim=-1)
    for _ in range(2 * greedy_head.TIMED_CALLS + 5):
        assert torch.equal(head.tokens(x, full), want)
    timed = greedy_head.TIMED_CALLS
    assert calls["twin"] >= timed and calls["full"] >= timed
    kept = head._choice[greedy_head._bucket(6)]
    # Once chosen, only the kept path runs.
    assert calls["twin" if kept else "full"] == timed + 5
    assert calls["full" if kept else "twin"] == timed
    assert greedy_head._bucket(5) == greedy_head._bucket(8) != greedy_head._bucket(9)


@pytest.fixture(scope="module")
def a8_model():
    return LlamaModel(tiny_quantized_checkpoint(seed=0), weights="native-a8")


def _engine(model, method: str = "none") -> Engine:
    config = EngineConfig(
        num_blocks=128,
        block_size=16,
        max_num_batched_tokens=512,
        speculative_method=method,  # type: ignore[arg-type]
        num_speculative_tokens=4,
    )
    return Engine(config, model=model)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(2)
    # Repeating prompts: n-gram drafts then find matches, so verify steps happen.
    return [list(rng.integers(3, 60, size=8)) * 4 for _ in range(8)]


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_greedy_rows_take_the_twin_and_keep_their_tokens(a8_model, monkeypatch, method):
    native = a8_model.native
    assert native.greedy is not None  # the tiny model's tied head is Q8_0
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    saved = native.greedy
    monkeypatch.setattr(native, "greedy", None)
    want = _engine(a8_model, method).generate(_prompts(), params)
    monkeypatch.setattr(native, "greedy", saved)
    used = []
    monkeypatch.setattr(
        saved, "tokens", lambda hidden, full: used.append(len(hidden)) or saved.argmax(hidden)
    )
    engine = _engine(a8_model, method)
    got = engine.generate(_prompts(), params)
    assert got == want
    assert used and max(used) > 1  # batched rows went through it
    if method == "ngram":
        assert engine.spec_stats()["verify_steps"] > 0
        assert max(used) > len(_prompts())  # verify rows too


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=8, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=8, presence_penalty=1.5),
        SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, max_tokens=8, seed=1),
    ],
    ids=["logprobs", "presence", "repetition", "sampled"],
)
@pytest.mark.parametrize("method", ["none", "ngram"])
def test_rows_that_read_their_logits_never_take_the_twin(a8_model, monkeypatch, params, method):
    native = a8_model.native
    saved = native.greedy
    monkeypatch.setattr(native, "greedy", None)
    want = _engine(a8_model, method).generate(_prompts()[:3], params)
    monkeypatch.setattr(native, "greedy", saved)

    def refuse(hidden, full):
        raise AssertionError("a row that reads its logits took the twin")

    monkeypatch.setattr(saved, "tokens", refuse)
    assert _engine(a8_model, method).generate(_prompts()[:3], params) == want


@pytest.mark.parametrize("flags", ["-O3 -mavx2 -mfma -mf16c", "-O3"], ids=["avx2", "scalar"])
def test_the_other_simd_builds_pick_the_same_tokens(flags, monkeypatch, tmp_path):
    """What an AVX2-only or non-x86 machine runs (its twin multiplies without VNNI-512)."""
    monkeypatch.setenv("SPLITSERVE_NATIVE_CFLAGS", flags)
    build = load(tmp_path)
    assert build.available, build.reason
    head, exact = _head(build.library, _blocks(seed=5))
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(5))
    x[0] = _dense(_blocks(seed=5))[5] * 40  # a planted tie
    assert torch.equal(head.argmax(x), exact(x).argmax(dim=-1))
